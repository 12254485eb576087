"""What the bench parts share: model shapes, timing, the random-weight model and its runner."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                 vocab_size=128256, tie_word_embeddings=False, torch_dtype="bfloat16",
                 bos_token_id=128000, eos_token_id=128001)
# A 2-layer shape with the same structure, for smoke-testing the bench on a CPU (--shape small).
SMALL = dict(LLAMA3_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=32000)
# DeepSeek-V3's structure (MLA with q and kv LoRA, interleaved YaRN rope, noaux_tc routing over 8
# expert groups, one shared expert, the first layer dense) sized so that its ACTIVE parameters per
# token match the Llama-3-8B shape's (the MLA decode-step comparison, scripts/gpu_mla_decode.py,
# prints both counts: 7.75B vs 8.03B at 32 layers, 96.5 %). Per layer: MLA 39M (Llama's GQA 42M);
# the shared expert + 8 routed experts of width 1536 compute 170M (Llama's MLP 176M). 64 experts
# make 40.5B parameters in all (81 GB in bf16). The same vocabulary as the Llama shape: the heads cost
# the same, so the ratio compares the bodies.
DSV3_8B_ACTIVE = dict(
    architectures=["DeepseekV3ForCausalLM"], hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, q_lora_rank=1536,
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
    n_shared_experts=1, moe_intermediate_size=1536, norm_topk_prob=True, routed_scaling_factor=2.5,
    rope_interleave=True, rms_norm_eps=1e-6, max_position_embeddings=163840,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1},
    vocab_size=128256, tie_word_embeddings=False, torch_dtype="bfloat16",
    bos_token_id=128000, eos_token_id=128001)
DSV3_SMALL = dict(DSV3_8B_ACTIVE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
                  qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=16,
                  moe_intermediate_size=64, vocab_size=32000)
# Qwen3-30B-A3B's released config.json (the fields the family reads): 48 layers of GQA attention
# (32 q / 4 kv heads of 128) with a sparse MoE block each, 128 experts of width 768, top-8,
# renormalised. 30.5B parameters (61 GB in bf16), 3.3B active per token. Issue 8's MoE shape.
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=40960, use_sliding_window=False, vocab_size=151936,
    tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)
QWEN3_MOE_SMALL = dict(QWEN3_30B_A3B, hidden_size=256, intermediate_size=512,
                       moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
                       vocab_size=32000, bos_token_id=1, eos_token_id=2)
# (HF config, the vocabulary rl-bitwise's model rows run): the Llama shapes' rl-bitwise rows keep
# the padded head they were first recorded with (below); later shapes run their own vocabulary.
SHAPES = {"llama3-8b": (LLAMA3_8B, 131072), "small": (SMALL, 32768),
          "dsv3-8b-active": (DSV3_8B_ACTIVE, 131072), "dsv3-small": (DSV3_SMALL, 32768),
          "qwen3-30b-a3b": (QWEN3_30B_A3B, 151936), "qwen3-moe-small": (QWEN3_MOE_SMALL, 32000)}
# The rl-bitwise rows keep the 131072-row head they were recorded with (docs/performance.md), though
# rl-bitwise serves 128256 itself since the last logprob block is completed (docs/numerics.md).
PADDED_VOCAB = 131072
ROWS = (1, 16, 64, 256, 4096)


def _checkpoint(args, result: dict) -> None:
    """Write what a part has measured so far: a part stopped by its timeout still reports."""
    if getattr(args, "child_out", None):
        with open(args.child_out, "w") as f:
            json.dump({**result, "partial": True}, f, default=str)


def _read_partial(path: str) -> dict:
    """What a child's _checkpoint wrote last ({} when it wrote nothing)."""
    if not os.path.getsize(path):
        return {}
    with open(path) as f:
        return json.load(f)


def run_streamed(argv: list[str], timeout: float, *, env: dict, show=lambda line: True,
                 merge_stderr: bool = False) -> tuple[int | None, list[str], list[str]]:
    """Run a child process under `timeout` s: (its return code, None when the timeout killed it;
    its stdout lines; its stderr lines). Each stdout line that `show` accepts is passed on to our
    stdout as it comes, not at the end: a device call cut short by its own limit still has in its
    log how far the child got. merge_stderr reads stderr as part of stdout."""
    proc = subprocess.Popen(argv, text=True, stdout=subprocess.PIPE, env=env,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
    out: list[str] = []
    err: list[str] = []

    def pump(stream, into, echo):  # a thread per pipe: neither may fill while the other is read
        for line in stream:
            into.append(line)
            if echo and show(line):
                sys.stdout.write(line)
                sys.stdout.flush()

    pumps = [threading.Thread(target=pump, args=(proc.stdout, out, True), daemon=True)]
    if not merge_stderr:
        pumps.append(threading.Thread(target=pump, args=(proc.stderr, err, False), daemon=True))
    for t in pumps:
        t.start()
    try:
        returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        returncode = None
    for t in pumps:
        t.join()
    return returncode, out, err


def _median_time(fn, iters: int, warmup: int = 2, back_to_back: int = 1, sync=None) -> float:
    """Median seconds per call. With back_to_back > 1 each sample is that many asynchronous calls
    followed by one `sync` of the last result, so host dispatch overlaps the device work."""
    for _ in range(warmup):
        out = fn()
    if sync:
        sync(out)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(back_to_back):
            out = fn()
        if sync:
            sync(out)
        times.append((time.perf_counter() - t0) / back_to_back)
    return statistics.median(times)


def _random_llama(base: dict, vocab: int):
    """A LoadedModel-like object whose checkpoint is random weights made from the model's own
    parameter specs, on the device (jengine.models.layers.param.RandomSource)."""
    from jengine.models.config import ModelConfig
    from jengine.models.layers.param import RandomSource

    class Loaded:
        config = ModelConfig.from_hf_dict({**base, "vocab_size": vocab})
        checkpoint = RandomSource(seed=0)
        eos_token_ids = (base["eos_token_id"],)
    return Loaded()


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _pool_tokens(rows, page_size: int) -> int:
    """KV pool (tokens) for (requests, tokens held per request) rows run one at a time: the largest
    row, in whole pages. Nothing more: a KV token costs 128 KiB on the Llama-3-8B shape."""
    return max(bs * _pages(tokens, page_size) for bs, tokens in rows) * page_size


def shape_config(shape: str, layers: int = 0) -> tuple[dict, int]:
    """(HF config dict, padded vocabulary) of a bench shape; `layers` > 0 replaces its layer count
    (a shorter model of the same widths, where a full one would not fit a time budget)."""
    base, padded = SHAPES[shape]
    return (dict(base, num_hidden_layers=layers) if layers else base), padded


def _config_and_family(base: dict):
    """(ModelConfig, its registered model family) of an HF config dict: what the counts below
    read, with no weights."""
    from jengine.models.config import ModelConfig
    from jengine.models.registry import get_family

    cfg = ModelConfig.from_hf_dict(base)
    return cfg, get_family(cfg.architecture)


def parameter_counts(base: dict) -> dict:
    """{"total", "active"} parameters of an HF config dict, from the family's own ParamSpecs (no
    weights): active counts num_experts_per_tok of each routed stack of num_experts experts."""
    import math

    cfg, family = _config_and_family(base)
    specs = family.param_specs(cfg, dtype=cfg.torch_dtype)
    experts = getattr(cfg, "num_experts", 0)
    total = active = 0
    for spec in specs.values():
        n = math.prod(spec.shape)
        total += n
        routed = experts and spec.stacked == experts
        active += n * cfg.num_experts_per_tok // experts if routed else n
    return {"total": total, "active": active}


def step_model(base: dict) -> dict | None:
    """What one step of a GQA shape must read and compute, in parameters, from the family's own
    ParamSpecs (no weights); None for an MLA shape (its attention is not q heads x head_dim wide).

      fixed        every weight a decode step reads whatever the routing: attention, norms,
                   routers, dense MLPs and the LM head -- not the embedding table (a step reads
                   its own rows of it)
      expert       one routed expert of one layer (0 for a dense shape): a decode step reads it
                   once for each (layer, expert) its rows route to, which the model part counts
      token_flop_params  the matrix parameters one prompt token multiplies through below the LM
                   head (num_experts_per_tok experts per MoE layer): prefill FLOPs 2 x this each
      attention_width, layers  q heads x head_dim and the layer count: the attention's FLOPs
      experts, moe_layers  routed experts per MoE layer and the MoE layers (0, 0 for a dense shape)
      kv_bytes_per_token  the KV cache one token holds (every layer)
    For the Llama-3-8B shape `fixed` is measures.py's 32 x LAYER_PARAMS + the LM head plus the
    norms' 266,240 (tests/test_bench.py)."""
    import math

    cfg, family = _config_and_family(base)
    if getattr(cfg, "kv_lora_rank", 0):
        return None
    specs = family.param_specs(cfg, dtype=cfg.torch_dtype)
    top_k = getattr(cfg, "num_experts_per_tok", 0)
    fixed = token = 0
    per_expert: dict[str, int] = {}  # each MoE layer's (`layers.N.`) parameters of one expert
    experts = 0
    for name, spec in specs.items():
        n = math.prod(spec.shape)
        if name.startswith("embed_tokens"):
            continue
        if spec.stacked:  # one projection of one layer's routed experts, stacked
            layer = ".".join(name.split(".")[:2])
            per_expert[layer] = per_expert.get(layer, 0) + n // spec.stacked
            token += top_k * (n // spec.stacked)
            experts = spec.stacked
            continue
        fixed += n
        if len(spec.shape) > 1 and not name.startswith("lm_head"):
            token += n
    if len(set(per_expert.values())) > 1:
        raise ValueError(f"step_model: MoE layers of different expert sizes {per_expert}")
    return {"fixed": fixed, "expert": next(iter(per_expert.values()), 0),
            "token_flop_params": token,
            "attention_width": cfg.num_attention_heads * cfg.head_dim,
            "layers": cfg.num_hidden_layers, "experts": experts, "moe_layers": len(per_expert),
            "kv_bytes_per_token": kv_bytes_per_token(base)}


def kv_bytes_per_token(base: dict) -> int:
    """KV-cache bytes one token holds in the model dtype (every layer), as /get_server_info says."""
    import numpy as np

    cfg, family = _config_and_family(base)
    spec = family.kv_cache_spec(cfg)
    return spec.values_per_token * np.dtype(cfg.torch_dtype).itemsize


def random_runner(shape: str, numerics: str, launch, *, layers: int = 0):
    """Resolve the launch, set its XLA flags (before JAX starts), build a ModelRunner of the bench
    `shape` (`layers` of it, see shape_config) on random weights (rl-bitwise pads the
    vocabulary). Returns (runner, plan, loaded)."""
    from jengine.numerics import resolve_launch

    resolved = resolve_launch(launch)
    resolved.apply_environment()
    import pallas_kernels  # noqa: F401  (registers every leaf, the GPU ones too, before planning)
    from jengine.engine.model_runner import ModelRunner
    from jengine.launch import plan_launch
    from jengine.profiles import override_profile

    base, padded = shape_config(shape, layers)
    loaded = _random_llama(base, padded if numerics != "auto" else base["vocab_size"])
    # Timing only: random weights prove nothing about the contract, so the model's verification
    # gate (require_verified_numerics) is overridden while this runner is built, and nothing else.
    with override_profile(base["architectures"][0], numerics_envelopes={numerics}):
        plan = plan_launch(resolved, loaded.config)
    return ModelRunner(loaded.config, loaded.checkpoint, plan.runner), plan, loaded
