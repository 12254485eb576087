"""Qwen3MoeForCausalLM: Qwen3's attention (per-head q/k RMSNorm) with sparse MoE layers
(jengine/models/moe_decoder.py): a softmax router choosing `num_experts_per_tok` of `num_experts`
SwiGLU experts of width `moe_intermediate_size`, the chosen probabilities renormalised when
`norm_topk_prob`.

Checkpoints hold a layer's experts one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...),
as `save_pretrained` writes them and released checkpoints are; that is what the specs name (stacked
on load, ParamSpec.stacked). transformers 5.x holds them fused in memory (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]): what a 5.x trainer's `named_parameters()` sends,
or a `state_dict()` saved as is. `checkpoint_view` reads that layout as the per-expert names
(jengine/models/fused_experts.py).
"""

from __future__ import annotations

from jengine.models.family import (ModelFamily, ModelProfile, hf_fused_experts_view,
                                   hf_moe_decoder_name, int_field, require_silu)

ARCHITECTURE = "Qwen3MoeForCausalLM"


def _int_field(d, name: str, default: int, *, minimum: int) -> int:
    return int_field(d, name, default, minimum=minimum, architecture=ARCHITECTURE)


def parse_config(d) -> dict:
    require_silu(d)
    if d.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported (sliding-window attention is "
                         f"not implemented; sliding_window={d.get('sliding_window')!r})")
    # transformers 5 writes num_local_experts (its attribute_map's name for num_experts).
    experts = d.get("num_experts", d.get("num_local_experts"))
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"num_experts={experts!r} must be a positive integer for {ARCHITECTURE}")
    top_k = _int_field(d, "num_experts_per_tok", 8, minimum=1)
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok={top_k} exceeds num_experts={experts}")
    mlp_only = d.get("mlp_only_layers") or []
    if not isinstance(mlp_only, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise ValueError(f"mlp_only_layers={mlp_only!r} must be a list of layer indices")
    for name in ("kv_lora_rank", "q_lora_rank", "shared_expert_intermediate_size"):
        if d.get(name):
            raise ValueError(f"{name}={d[name]!r} is not supported for {ARCHITECTURE}")
    bias = bool(d.get("attention_bias") or False)
    return dict(attention_bias=bias, attention_output_bias=bias, qk_norm=True,
                num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=_int_field(d, "moe_intermediate_size", 0, minimum=1),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                decoder_sparse_step=_int_field(d, "decoder_sparse_step", 1, minimum=1),
                mlp_only_layers=tuple(mlp_only))


# HF's per-expert tensor names; transformers 5's fused in-memory layout read as them.
checkpoint_name = hf_moe_decoder_name
checkpoint_view = hf_fused_experts_view


# rl-bitwise: the invariance harness passes at EP4 (tests/test_expert_parallel.py) and HF's forward
# under trainer mode aligns bit for bit (tests/test_moe_align.py), on the CPU.
EntryClass = ModelFamily(
    architecture=ARCHITECTURE, model_type="qwen3_moe",
    profile=ModelProfile(ARCHITECTURE, frozenset({"rl-bitwise"}),
                         "sparse MoE (softmax router, top-k SwiGLU experts); Qwen3 attention"),
    parse_config=parse_config, checkpoint_name=checkpoint_name, body="jengine.models.moe_decoder",
    checkpoint_view=checkpoint_view)
