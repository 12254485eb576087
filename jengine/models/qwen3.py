"""Qwen3ForCausalLM: the dense body with a per-head RMSNorm on q and k; attention_bias, when set,
biases q/k/v and o_proj as in Llama."""

from __future__ import annotations

from jengine.models.family import ModelFamily, ModelProfile, dense_config_rules, hf_decoder_name

ARCHITECTURE = "Qwen3ForCausalLM"


def parse_config(d) -> dict:
    dense_config_rules(d, ARCHITECTURE)
    bias = bool(d.get("attention_bias") or False)
    return dict(attention_bias=bias, attention_output_bias=bias, qk_norm=True)


# rl-bitwise: tests/test_invariance.py (the tiny Qwen3 model) and tests/test_interop_align.py.
EntryClass = ModelFamily(
    architecture=ARCHITECTURE, model_type="qwen3",
    profile=ModelProfile(ARCHITECTURE, frozenset({"rl-bitwise"}),
                         "dense; per-head RMSNorm on q and k (qk_norm=True)"),
    parse_config=parse_config, checkpoint_name=hf_decoder_name, body="jengine.models.dense")
