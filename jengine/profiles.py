"""Model profiles: what each registered architecture has been verified under.

Each family declares its profile (jengine/models/{llama,qwen2,qwen3}.py); ``PROFILES`` is the live
table built from them, which ``override_profile`` edits for a test.

``numerics_envelopes`` lists the envelopes (other than auto) a model has passed end to end -- the
invariance harness and the teacher-forced comparison against a trainer dump. Launching such an
envelope refuses a model whose profile does not list it (``require_verified_numerics``, checked by
``jengine.numerics.check_model``). Per the spec, in-tree models start WITHOUT the rl-bitwise
declaration; it is added in the same change that adds the passing harness test for that model.
"""

from __future__ import annotations

import contextlib
import dataclasses

from jengine.models import registry
from jengine.models.family import ModelProfile

__all__ = ["PROFILES", "ModelProfile", "get_profile", "override_profile"]

PROFILES: dict[str, ModelProfile] = {
    arch: registry.get_family(arch).profile for arch in registry.architectures()}


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
