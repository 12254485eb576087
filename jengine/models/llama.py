"""LlamaForCausalLM: the dense body as it is (no qkv bias unless attention_bias, which then also
puts a bias on o_proj; no q/k norm)."""

from __future__ import annotations

from jengine.models.family import ModelFamily, ModelProfile, dense_config_rules, hf_decoder_name

ARCHITECTURE = "LlamaForCausalLM"


def parse_config(d) -> dict:
    dense_config_rules(d, ARCHITECTURE)
    bias = bool(d.get("attention_bias") or False)
    return dict(attention_bias=bias, attention_output_bias=bias, qk_norm=False)


# rl-bitwise: tests/test_invariance.py (the invariance harness on tiny random Llama checkpoints)
# and tests/test_interop_align.py (teacher-forced trainer dumps, bitwise).
EntryClass = ModelFamily(
    architecture=ARCHITECTURE, model_type="llama",
    profile=ModelProfile(ARCHITECTURE, frozenset({"rl-bitwise"}),
                         "dense; no qkv bias, no qk-norm; tied or untied head"),
    parse_config=parse_config, checkpoint_name=hf_decoder_name, body="jengine.models.dense")
