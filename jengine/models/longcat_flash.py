"""LongcatFlashForCausalLM (transformers 5.24's `models/longcat_flash`): each of `num_layers` decoder
layers holds two MLA attention blocks and two dense SwiGLU MLPs, plus a "shortcut" MoE read from the
first MLP's input and added at the layer's end (jengine/models/longcat_decoder.py). The MLA is
DeepSeek's with a query LoRA always present and the LoRA norm scales (`--mla-lora-scale`,
jengine/models/layers/mla.py); the MoE is DeepSeek's layer (jengine/models/layers/deepseek_moe.py)
with a softmax router, one group, no normalisation, `routed_scaling_factor`, and `zero_expert_num`
identity experts.

config.json spells the shared fields its own way (HF's attribute_map): num_layers (ModelConfig's
num_hidden_layers counts these decoder layers; HF's `num_hidden_layers` property is twice it, the
attention blocks), ffn_hidden_size (the two dense MLPs), n_routed_experts, moe_topk,
expert_ffn_hidden_size. Refused, naming the field: router_bias (the engine's router has no bias),
a rotary `head_dim` other than qk_rope_head_dim (HF's rotary reads head_dim), a `qk_head_dim` other
than nope + rope, a `num_hidden_layers` other than 2 * num_layers, hidden_act other than silu.
The MTP layers (`model.mtp.*`) are not read, as HF does not read them.
"""

from __future__ import annotations

import re

from jengine.models.family import (ModelFamily, ModelProfile, hf_decoder_name, int_field,
                                   require_silu)

ARCHITECTURE = "LongcatFlashForCausalLM"


def _int(d, name: str, default=None, *, minimum: int = 1) -> int:
    return int_field(d, name, default, minimum=minimum, architecture=ARCHITECTURE)


def parse_config(d) -> dict:
    require_silu(d)
    if d.get("router_bias"):
        raise ValueError(f"router_bias={d['router_bias']!r} is not supported for {ARCHITECTURE} "
                         "(the engine's router GEMM has no bias)")
    layers = _int(d, "num_layers")
    if d.get("num_hidden_layers") not in (None, 2 * layers):
        raise ValueError(f"num_hidden_layers={d['num_hidden_layers']!r} must be 2 * num_layers="
                         f"{2 * layers} for {ARCHITECTURE} (two attention blocks per layer)")
    nope, rope = _int(d, "qk_nope_head_dim"), _int(d, "qk_rope_head_dim")
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim={rope} must be even (rotary pairs)")
    if d.get("head_dim") not in (None, rope):
        raise ValueError(f"head_dim={d['head_dim']!r} must equal qk_rope_head_dim={rope} for "
                         f"{ARCHITECTURE} (HF's rotary embedding is head_dim wide)")
    if d.get("qk_head_dim") not in (None, nope + rope):
        raise ValueError(f"qk_head_dim={d['qk_head_dim']!r} must equal qk_nope_head_dim + "
                         f"qk_rope_head_dim = {nope + rope} for {ARCHITECTURE}")
    experts = _int(d, "n_routed_experts")
    zero = _int(d, "zero_expert_num", 0, minimum=0)
    top_k = _int(d, "moe_topk")
    if top_k > experts + zero:
        raise ValueError(f"moe_topk={top_k} exceeds n_routed_experts + zero_expert_num = "
                         f"{experts + zero}")
    scale = d.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"routed_scaling_factor={scale!r} must be a positive number for "
                         f"{ARCHITECTURE}")
    bias = bool(d.get("attention_bias") or False)
    return dict(num_hidden_layers=layers, intermediate_size=_int(d, "ffn_hidden_size"),
                attention_bias=bias, attention_output_bias=bias, qk_norm=False,
                kv_lora_rank=_int(d, "kv_lora_rank"), q_lora_rank=_int(d, "q_lora_rank"),
                qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=_int(d, "v_head_dim"),
                rope_interleave=True,  # HF's LongcatFlashMLA always rotates interleaved pairs
                mla_lora_scale=True,
                num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=_int(d, "expert_ffn_hidden_size"),
                norm_topk_prob=False, n_group=1, topk_group=1,
                routed_scaling_factor=float(scale), n_shared_experts=0, zero_expert_num=zero,
                router_score="softmax", router_in_fp32=False,
                head_dim=rope)  # the rotary tables' width


_EXPERT_PARAM = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
_ROUTER_PARAM = re.compile(r"^(layers\.\d+\.mlp)\.gate\.(weight|e_score_correction_bias)$")


def checkpoint_name(cfg, path: str) -> str:
    """HF's names: the engine's paths are HF's module paths (self_attn.{0,1}, mlps.{0,1},
    input_layernorm.{0,1}, ...) except the router, HF's `mlp.router.classifier` (the engine's
    `mlp.gate`), and the stacked experts, read one tensor per expert ("{}" = the expert) as
    `save_pretrained` writes them (its gate/up tensors for the zero experts are not read)."""
    m = _ROUTER_PARAM.match(path)
    if m:
        name = "classifier.weight" if m.group(2) == "weight" else "e_score_correction_bias"
        return f"model.{m.group(1)}.router.{name}"
    m = _EXPERT_PARAM.match(path)
    if m:
        return f"model.{m.group(1)}.{{}}.{m.group(2)}.weight"
    return hf_decoder_name(cfg, path)


# rl-bitwise: the invariance harness passes and HF's forward under trainer mode (absorbed MLA with
# HF's runtime LoRA scales, the softmax router and zero experts through the twins) aligns bit for
# bit (tests/test_longcat_flash.py), on the CPU. One device only (no TP, no EP).
EntryClass = ModelFamily(
    architecture=ARCHITECTURE, model_type="longcat_flash",
    profile=ModelProfile(ARCHITECTURE, frozenset({"rl-bitwise"}),
                         "two absorbed-MLA blocks and two MLPs per layer, shortcut MoE with zero "
                         "experts; one device"),
    parse_config=parse_config, checkpoint_name=checkpoint_name,
    body="jengine.models.longcat_decoder")
