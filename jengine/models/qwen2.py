"""Qwen2ForCausalLM: the dense body with q/k/v biases always (whatever attention_bias says) and
never an o_proj bias."""

from __future__ import annotations

from jengine.models.family import ModelFamily, ModelProfile, dense_config_rules, hf_decoder_name

ARCHITECTURE = "Qwen2ForCausalLM"


def parse_config(d) -> dict:
    dense_config_rules(d, ARCHITECTURE)
    return dict(attention_bias=True, attention_output_bias=False, qk_norm=False)


# rl-bitwise: tests/test_invariance.py and tests/test_interop_align.py (tiny random Qwen2).
EntryClass = ModelFamily(
    architecture=ARCHITECTURE, model_type="qwen2",
    profile=ModelProfile(ARCHITECTURE, frozenset({"rl-bitwise"}),
                         "dense; qkv bias (attention_bias=True)"),
    parse_config=parse_config, checkpoint_name=hf_decoder_name, body="jengine.models.dense")
