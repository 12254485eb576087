"""DeepseekV3ForCausalLM: multi-head latent attention (absorbed, one latent KV page per position:
jengine/models/layers/mla.py) with YaRN rope, RMSNorm and SwiGLU; the first
`first_k_dense_replace` layers dense, the rest DeepSeek-MoE (noaux_tc router, shared experts).

The MoE layers are not built here yet (jengine/models/layers/deepseek_moe.py lands separately): a
config whose layers are all dense (`first_k_dense_replace >= num_hidden_layers`) loads, any other
is refused naming the layers it would have to route.
"""

from __future__ import annotations

from jengine.models.family import ModelFamily, ModelProfile, hf_decoder_name, int_field

ARCHITECTURE = "DeepseekV3ForCausalLM"


def _positive_int(d, name: str, default=None) -> int:
    return int_field(d, name, default, minimum=1, architecture=ARCHITECTURE)


def parse_config(d) -> dict:
    hidden_act = d.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act={hidden_act!r} is not supported (supported: 'silu')")
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
    if first_dense < layers:
        raise ValueError(
            f"{ARCHITECTURE}: layers {first_dense}..{layers - 1} are MoE layers "
            f"(first_k_dense_replace={first_dense} < num_hidden_layers={layers}, "
            f"n_routed_experts={d.get('n_routed_experts')!r}); DeepSeek's MoE layer is not "
            "implemented yet: only configs whose layers are all dense "
            "(first_k_dense_replace >= num_hidden_layers) load")
    bias = bool(d.get("attention_bias") or False)
    return dict(attention_bias=bias, attention_output_bias=bias, qk_norm=False,
                kv_lora_rank=_positive_int(d, "kv_lora_rank"), q_lora_rank=q_lora_rank or 0,
                qk_rope_head_dim=rope_dim, qk_nope_head_dim=_positive_int(d, "qk_nope_head_dim"),
                v_head_dim=_positive_int(d, "v_head_dim"),
                rope_interleave=bool(d.get("rope_interleave", True)),  # HF's default
                first_k_dense_replace=first_dense,
                head_dim=rope_dim)  # the rotary tables' width (HF: config.head_dim)


# rl-bitwise: the invariance harness passes and HF's forward under trainer mode (absorbed MLA through
# the twins, interop/trainer_mla.py) aligns bit for bit (tests/test_mla_align.py), on the CPU.
EntryClass = ModelFamily(
    architecture=ARCHITECTURE, model_type="deepseek_v3",
    profile=ModelProfile(ARCHITECTURE, frozenset({"rl-bitwise"}),
                         "absorbed MLA (one latent KV page per position), YaRN; dense layers only"),
    parse_config=parse_config, checkpoint_name=hf_decoder_name, body="jengine.models.mla_decoder")
