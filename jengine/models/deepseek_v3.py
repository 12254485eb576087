"""DeepseekV3ForCausalLM: multi-head latent attention (absorbed, one latent KV page per position:
jengine/models/layers/mla.py) with YaRN rope, RMSNorm and SwiGLU; the first
`first_k_dense_replace` layers dense, the rest DeepSeek-MoE (jengine/models/layers/deepseek_moe.py:
the noaux_tc correction-bias router, routed experts in slot order, shared experts), as HF's
`DeepseekV3DecoderLayer` (`layer_idx >= first_k_dense_replace` routes).

Config fields missing from config.json take HF `DeepseekV3Config`'s defaults (what HF would load).
The router's method and score function are not HF config fields (HF always runs noaux_tc with
sigmoid scores); released checkpoints state them (`topk_method`, `scoring_func`), so another value
is refused rather than served as a different model.
"""

from __future__ import annotations

from jengine.models.family import (ModelFamily, ModelProfile, hf_fused_experts_view,
                                   hf_moe_decoder_name, int_field, require_silu)

ARCHITECTURE = "DeepseekV3ForCausalLM"


def _positive_int(d, name: str, default=None) -> int:
    return int_field(d, name, default, minimum=1, architecture=ARCHITECTURE)


def parse_config(d) -> dict:
    require_silu(d)
    q_lora_rank = d.get("q_lora_rank")
    if q_lora_rank is not None:
        q_lora_rank = _positive_int(d, "q_lora_rank")
    rope_dim = _positive_int(d, "qk_rope_head_dim")
    if rope_dim % 2:
        raise ValueError(f"qk_rope_head_dim={rope_dim} must be even (rotary pairs)")
    layers = _positive_int(d, "num_hidden_layers")
    first_dense = int_field(d, "first_k_dense_replace", 3, minimum=0,  # 3: HF's default
                            architecture=ARCHITECTURE)
    if d.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={d['moe_layer_freq']!r} is not supported for "
                         f"{ARCHITECTURE} (HF's DeepseekV3 routes every layer from "
                         "first_k_dense_replace on)")
    moe = _moe_fields(d) if first_dense < layers else {}
    bias = bool(d.get("attention_bias") or False)
    return dict(attention_bias=bias, attention_output_bias=bias, qk_norm=False,
                kv_lora_rank=_positive_int(d, "kv_lora_rank"), q_lora_rank=q_lora_rank or 0,
                qk_rope_head_dim=rope_dim, qk_nope_head_dim=_positive_int(d, "qk_nope_head_dim"),
                v_head_dim=_positive_int(d, "v_head_dim"),
                rope_interleave=bool(d.get("rope_interleave", True)),  # HF's default
                first_k_dense_replace=first_dense,
                head_dim=rope_dim,  # the rotary tables' width (HF: config.head_dim)
                **moe)


def _moe_fields(d) -> dict:
    """The MoE layers' fields (HF DeepseekV3Config's defaults where config.json omits one)."""
    for name, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if d.get(name, want) != want:
            raise ValueError(f"{name}={d[name]!r} is not supported for {ARCHITECTURE} (supported: "
                             f"{want!r}, the router HF's DeepseekV3TopkRouter runs)")
    # transformers 5 maps num_local_experts onto n_routed_experts (its attribute_map).
    experts = d.get("n_routed_experts", d.get("num_local_experts", 256))
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"n_routed_experts={experts!r} must be an integer >= 1 for {ARCHITECTURE}")
    top_k = _positive_int(d, "num_experts_per_tok", 8)
    n_group = _positive_int(d, "n_group", 8)
    topk_group = _positive_int(d, "topk_group", 4)
    if experts % n_group:
        raise ValueError(f"n_group={n_group} must divide n_routed_experts={experts}")
    group = experts // n_group
    if n_group > 1 and group < 2:
        raise ValueError(f"n_group={n_group} leaves groups of {group} expert of "
                         f"n_routed_experts={experts}; a group's score is its top-2 sum")
    if topk_group > n_group:
        raise ValueError(f"topk_group={topk_group} exceeds n_group={n_group}")
    if top_k > topk_group * group:
        raise ValueError(f"num_experts_per_tok={top_k} exceeds the {topk_group * group} experts "
                         f"of topk_group={topk_group} groups of {group}")
    scale = d.get("routed_scaling_factor", 2.5)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"routed_scaling_factor={scale!r} must be a positive number for "
                         f"{ARCHITECTURE}")
    return dict(num_experts=experts, num_experts_per_tok=top_k, n_group=n_group,
                topk_group=topk_group, routed_scaling_factor=float(scale),
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                n_shared_experts=int_field(d, "n_shared_experts", 1, minimum=0,
                                           architecture=ARCHITECTURE),
                moe_intermediate_size=_positive_int(d, "moe_intermediate_size", 2048),
                router_score="sigmoid")


# rl-bitwise: the invariance harness passes (at EP1 and EP4 with MoE layers) and HF's forward under
# trainer mode (absorbed MLA, interop/trainer_mla.py; router and experts, interop/trainer_moe.py)
# aligns bit for bit (tests/test_mla_align.py), on the CPU.
EntryClass = ModelFamily(
    architecture=ARCHITECTURE, model_type="deepseek_v3",
    profile=ModelProfile(ARCHITECTURE, frozenset({"rl-bitwise"}),
                         "absorbed MLA (one latent KV page per position), YaRN; "
                         "noaux_tc MoE with shared experts"),
    parse_config=parse_config, checkpoint_name=hf_moe_decoder_name,
    body="jengine.models.mla_decoder", checkpoint_view=hf_fused_experts_view)
