"""Tiny random HF checkpoints of the dense families, for interop's tests and the docs' walkthrough.

``make_tiny_hf_model(directory, "Qwen3ForCausalLM")`` writes an ordinary transformers directory
(config.json, model.safetensors via ``save_pretrained``, and the embedded tiny model's tokenizer with
its chat template) that both HF transformers and jengine load. Vocabulary 32768 (one rl-bitwise
block) unless ``vocab_size`` says otherwise, hidden 64, 2 layers. Weights are drawn like jengine's tiny model (projections ~ N(0,
1/fan_in), norm weights 1 + N(0, 0.1^2)) so that every layer moves the logits: with transformers'
default 0.02 init the activations vanish below bf16's resolution and alignment bugs hide.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from jengine.logprob_orders import BLOCKWISE_VOCAB_BLOCK

VOCAB_SIZE = BLOCKWISE_VOCAB_BLOCK

# Per family: what differs (qkv bias, qk-norm, tied head, rope theta, experts).
FAMILY_CONFIGS = {
    "LlamaForCausalLM": dict(rope_theta=500000.0, tie_word_embeddings=False, attention_bias=False),
    "Qwen2ForCausalLM": dict(rope_theta=1000000.0, tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False),
    "Qwen3MoeForCausalLM": dict(rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True),
    # MLA with both low-rank paths and interleaved YaRN rope (DeepSeek-V3's own rope_scaling,
    # mscale = mscale_all_dim: the softmax scale grows by mscale^2); layer 0 dense, layers 1-2
    # DeepSeek-MoE (16 experts in 4 groups, 2 groups kept, top-4, one shared expert), each with a
    # non-zero random e_score_correction_bias (_draw_weights; HF initialises it to zeros, which
    # would leave the bias's role in the choice untested).
    "DeepseekV3ForCausalLM": dict(
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, num_hidden_layers=3,
        num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, first_k_dense_replace=1, rope_interleave=True,
        n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_group=4,
        topk_group=2, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1}),
    # Two MLA blocks, two MLPs and a shortcut MoE per layer; LoRA norm scales sqrt(64 / 48) and
    # sqrt(64 / 32); a softmax router over 8 real and 4 zero (identity) experts, 3 per token, with
    # a non-zero correction bias (make_tiny_hf_model draws it).
    "LongcatFlashForCausalLM": dict(
        rope_theta=10000000.0, tie_word_embeddings=False, attention_bias=False,
        q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
        n_routed_experts=8, zero_expert_num=4, moe_topk=3, expert_ffn_hidden_size=32,
        routed_scaling_factor=6.0),
}


def _config(architecture: str, eos_token_id: int, pad_token_id: int, vocab_size: int = VOCAB_SIZE,
            **overrides):
    import transformers

    if architecture not in FAMILY_CONFIGS:
        raise ValueError(f"architecture={architecture!r} is not one of {sorted(FAMILY_CONFIGS)}")
    extra = dict(FAMILY_CONFIGS[architecture])
    theta = extra.pop("rope_theta")
    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    rope = {"rope_type": "default", "rope_theta": theta}
    if "rope_parameters" in extra:  # the family's own rope (DeepSeek's YaRN)
        rope = {**extra.pop("rope_parameters"), "rope_theta": theta}
    if architecture == "DeepseekV3ForCausalLM":
        del dims["num_key_value_heads"], dims["head_dim"]  # MLA: heads alike; head_dim = rope dim
    if architecture == "LongcatFlashForCausalLM":  # its own names; head_dim = the rope dim
        del dims["num_key_value_heads"]
        dims.update(num_layers=dims.pop("num_hidden_layers"),
                    ffn_hidden_size=dims.pop("intermediate_size"))
    for name in [n for n in extra if n in dims]:  # the family's own size (DeepSeek: 3 layers)
        dims[name] = extra.pop(name)
    if "rope_parameters" in overrides:
        rope = {**overrides.pop("rope_parameters"), "rope_theta": theta}
    for name in [n for n in overrides if n in extra]:  # a family field (num_experts_per_tok, ...)
        extra[name] = overrides.pop(name)
    dims.update(overrides)
    cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config,
           "Qwen3ForCausalLM": transformers.Qwen3Config,
           "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
           "DeepseekV3ForCausalLM": transformers.DeepseekV3Config,
           "LongcatFlashForCausalLM": transformers.LongcatFlashConfig}[architecture]
    return cls(vocab_size=vocab_size, rms_norm_eps=1e-6, rope_parameters=rope, **dims,
               eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None,
               architectures=[architecture], dtype="bfloat16", **extra)


def _draw_weights(model, seed: int, weight_std: float | None = None) -> None:
    """Overwrite every parameter with the scale scheme above (float64 draws -> f32 -> bf16);
    ``weight_std``: every >= 2-D parameter ~ N(0, weight_std^2) instead."""
    import torch

    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shape = tuple(p.shape)
            if weight_std is not None and len(shape) >= 2:
                w = weight_std * rng.standard_normal(shape)
            elif name.endswith("norm.weight") or re.search(r"norm\.\d+\.weight$", name):
                w = 1.0 + 0.1 * rng.standard_normal(shape)
            elif name.endswith("embed_tokens.weight"):
                w = 0.25 * rng.standard_normal(shape)
            elif name.endswith(".bias"):
                w = 0.1 * rng.standard_normal(shape)
            else:  # [out, in] projections and an untied head
                w = rng.standard_normal(shape) / np.sqrt(shape[-1])
            p.copy_(torch.from_numpy(w.astype(np.float32)).to(p.dtype))


def _draw_correction_biases(routers, seed: int) -> None:
    """Each router's e_score_correction_bias (a buffer, which _draw_weights does not reach) ~
    N(0, 0.1^2): comparable to the spread of the sigmoid scores, so it changes which experts win."""
    import torch

    rng = np.random.default_rng(seed + 1)
    with torch.no_grad():
        for router in routers:
            bias = router.e_score_correction_bias
            bias.copy_(torch.from_numpy(0.1 * rng.standard_normal(tuple(bias.shape))).to(bias.dtype))


def make_tiny_hf_model(directory, architecture: str = "Qwen3ForCausalLM", *, seed: int = 0,
                       vocab_size: int = VOCAB_SIZE, weight_std: float | None = None,
                       **config_overrides) -> Path:
    """Write a tiny random ``architecture`` checkpoint into ``directory`` and return its path.

    ``config_overrides``: config fields to change (``head_dim=128``, ``num_key_value_heads=1``,
    ``rope_parameters={"rope_type": "llama3", ...}`` -- the family's theta is kept), e.g. for the
    production head geometry the CPU suite also runs (tests/test_production_shapes.py).
    ``weight_std``: draw every >= 2-D parameter from N(0, weight_std^2) (a user's quick random
    checkpoint) instead of the fan-in scheme."""
    import torch
    import transformers

    from jengine.models import tiny

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _, special_ids = tiny._tokenizer_json()
    config = _config(architecture, special_ids[tiny.IM_END], special_ids[tiny.ENDOFTEXT], vocab_size,
                     **config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.bfloat16)
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    for router in routers:  # HF keeps the router in f32 (_keep_in_fp32_modules_strict)
        router.float()
    _draw_weights(model, seed, weight_std)
    _draw_correction_biases(routers, seed)
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return directory


def write_tiny_tokenizer(directory) -> dict[str, int]:
    """The embedded tiny model's tokenizer and chat template, as HF files; returns its special ids."""
    from jengine.models import tiny

    directory = Path(directory)
    tokenizer_json, special_ids = tiny._tokenizer_json()
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": tiny.IM_END,
        "pad_token": tiny.ENDOFTEXT, "add_bos_token": False, "add_eos_token": False,
        "chat_template": tiny.CHAT_TEMPLATE, "model_max_length": 2048,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n",
                                                     encoding="utf-8")
    return special_ids


def make_certain_token_model(directory, architecture: str = "Qwen3ForCausalLM", *,
                             tokens: tuple[int, int] = (1000, 2000), seed: int = 0) -> Path:
    """A tiny model whose next token is (nearly always) certain: logprob exactly ±0.0.

    The final norm keeps only hidden dimension 0 and the LM head reads only that dimension, with
    +4096 for ``tokens[0]`` and -4096 for ``tokens[1]``: whichever has the positive logit beats
    every other token by thousands, so the fp32 sum of exp is exactly 1 and the logprob of that
    token is -0.0 in the negative cross-entropy form and +0.0 in the direct form -- the case that
    tells the two signed-zero forms apart. Needs an untied head (Llama, Qwen3 configs here).
    """
    import torch
    import transformers

    if FAMILY_CONFIGS[architecture].get("tie_word_embeddings"):
        raise ValueError(f"{architecture}'s tiny config ties the head; use Llama or Qwen3")
    directory = make_tiny_hf_model(directory, architecture, seed=seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tokens[0], 0] = 4096.0
        model.lm_head.weight[tokens[1], 0] = -4096.0
    model.save_pretrained(directory)
    return directory
