"""Model profiles: what each supported architecture has been verified under.

``numerics_envelopes`` lists the envelopes (other than auto) a model has passed end to end -- the
invariance harness and the teacher-forced comparison against a trainer dump. Launching such an
envelope refuses a model whose profile does not list it (``require_verified_numerics``, checked by
``jengine.numerics.check_model``). Per the spec, in-tree models start WITHOUT the rl-bitwise
declaration; it is added in the same change that adds the passing harness test for that model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelProfile:
    architecture: str  # the Hugging Face class name in config.json "architectures"
    numerics_envelopes: frozenset[str] = frozenset()
    notes: str = ""


PROFILES: dict[str, ModelProfile] = {
    p.architecture: p
    for p in (
        # rl-bitwise for every dense family: tests/test_invariance.py (the invariance harness on the
        # tiny Qwen3 model and on tiny random Llama / Qwen2 checkpoints) and
        # tests/test_interop_align.py (teacher-forced trainer dumps of all three, bitwise).
        ModelProfile("LlamaForCausalLM", frozenset({"rl-bitwise"}),
                     "dense; no qkv bias, no qk-norm; tied or untied head"),
        ModelProfile("Qwen2ForCausalLM", frozenset({"rl-bitwise"}),
                     "dense; qkv bias (attention_bias=True)"),
        ModelProfile("Qwen3ForCausalLM", frozenset({"rl-bitwise"}),
                     "dense; per-head RMSNorm on q and k (qk_norm=True)"),
    )
}


def get_profile(architecture: str) -> ModelProfile:
    try:
        return PROFILES[architecture]
    except KeyError:
        raise ValueError(f"architecture={architecture!r} is not supported; supported: "
                         f"{sorted(PROFILES)}") from None


@contextlib.contextmanager
def override_profile(architecture: str, *, numerics_envelopes=None, notes: str | None = None):
    """Test hook: temporarily replace an architecture's profile (e.g. declare rl-bitwise).

    Creates a profile for an unknown architecture and removes it afterwards.
    """
    old = PROFILES.get(architecture)
    base = old or ModelProfile(architecture)
    changes = {}
    if numerics_envelopes is not None:
        changes["numerics_envelopes"] = frozenset(numerics_envelopes)
    if notes is not None:
        changes["notes"] = notes
    PROFILES[architecture] = dataclasses.replace(base, **changes)
    try:
        yield PROFILES[architecture]
    finally:
        if old is None:
            PROFILES.pop(architecture, None)
        else:
            PROFILES[architecture] = old
