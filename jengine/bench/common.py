"""What the bench parts share: model shapes, timing, the random-weight model and its runner."""

from __future__ import annotations

import json
import statistics
import time

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                 vocab_size=128256, tie_word_embeddings=False, torch_dtype="bfloat16",
                 bos_token_id=128000, eos_token_id=128001)
# A 2-layer shape with the same structure, for smoke-testing the bench on a CPU (--shape small).
SMALL = dict(LLAMA3_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=32000)
SHAPES = {"llama3-8b": (LLAMA3_8B, 131072), "small": (SMALL, 32768)}
# The rl-bitwise rows keep the 131072-row head they were recorded with (docs/performance.md), though
# rl-bitwise serves 128256 itself since the last logprob block is completed (docs/numerics.md).
PADDED_VOCAB = 131072
ROWS = (1, 16, 64, 256, 4096)


def _checkpoint(args, result: dict) -> None:
    """Write what a part has measured so far: a part stopped by its timeout still reports."""
    if getattr(args, "child_out", None):
        with open(args.child_out, "w") as f:
            json.dump({**result, "partial": True}, f, default=str)


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
        eos_token_ids = (128001,)
    return Loaded()


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _pool_tokens(rows, page_size: int) -> int:
    """KV pool (tokens) for (requests, tokens held per request) rows run one at a time: the largest
    row, in whole pages. Nothing more: a KV token costs 128 KiB on the Llama-3-8B shape."""
    return max(bs * _pages(tokens, page_size) for bs, tokens in rows) * page_size


def random_runner(shape: str, numerics: str, launch):
    """Resolve the launch, set its XLA flags (before JAX starts), build a ModelRunner of the bench
    `shape` on random weights (rl-bitwise pads the vocabulary). Returns (runner, plan, loaded)."""
    from jengine.numerics import resolve_launch

    resolved = resolve_launch(launch)
    resolved.apply_environment()
    import pallas_kernels  # noqa: F401  (registers every leaf, the GPU ones too, before planning)
    from jengine.engine.model_runner import ModelRunner
    from jengine.launch import plan_launch
    from jengine.profiles import override_profile

    base, padded = SHAPES[shape]
    loaded = _random_llama(base, padded if numerics != "auto" else base["vocab_size"])
    # Timing only: random weights prove nothing about the contract, so the model's verification
    # gate (require_verified_numerics) is overridden while this runner is built, and nothing else.
    with override_profile(base["architectures"][0], numerics_envelopes={numerics}):
        plan = plan_launch(resolved, loaded.config)
    return ModelRunner(loaded.config, loaded.checkpoint, plan.runner), plan, loaded
