"""("attention", "rope_paged"): a layer's rope_write and paged attention as one operator, so a GPU
can run them as one launch (pallas_kernels/triton_rope_attention.py).

``rope_paged(q, k, v, cos, sin, kv, page, slot, block_tables, token_req, positions, *, scale)`` is
``rope_write(q, k, v, cos, sin, kv, page, slot)`` -> (rotated q, kv), then
``paged attention(rotated q, kv, block_tables, token_req, positions, scale=scale)`` -> (out, kv).

**On by default** since the thirty-second session (an H100 measured the one launch faster at a
decode step of 1 and as fast at 16 rows, every golden bit unchanged: docs/performance.md).
A leaf of this family gives, bit for bit, the two leaves it composes and names them in a feature
(`composes`, the mechanics of pallas_kernels/gemm_epilogues.py): a model plans it only as the
composition of exactly the rope_write and attention leaves it planned anyway (`plan_fused`), so
it can never move a bit. ``JENGINE_ATTENTION_ROPE=off`` (`form`) makes the layer call the
two leaves (an A/B's "before"). The portable leaf here exists so that the layer's fused path runs
(and is tested) on every machine.
"""

from __future__ import annotations

import logging
import os

from pallas_kernels.attention import paged_fixed_order
from pallas_kernels.gemm_epilogues import composes
from pallas_kernels.registry import KernelPlanError, Priority, declare_family, plan, register
from pallas_kernels.rope_write import rope_write

logger = logging.getLogger(__name__)

ENV = "JENGINE_ATTENTION_ROPE"
FORMS = ("fused", "off")  # what ENV may say; unset or "": "fused"


def _rope_paged_signature(q, k, v, cos, sin, kv, page, slot, block_tables, token_req, positions,
                          *, scale):
    """q[T, Hq, D], k/v [T, Hkv, D], cos/sin [T, D], kv = (k_pages, v_pages), page/slot int32[T],
    block_tables [R, P], token_req/positions [T] -> (attention output [T, Hq, D], kv with the
    rotated k and v written)."""


declare_family("attention", "rope_paged", _rope_paged_signature)


def form() -> str:
    """JENGINE_ATTENTION_ROPE as set: "" (unset or empty: the fused leaf), "fused" (asked for
    explicitly) or "off" (the two leaves). Another value is an error naming the variable and the
    value."""
    value = os.environ.get(ENV) or ""
    if value and value not in FORMS:
        raise ValueError(f"{ENV}={value!r}: expected one of {list(FORMS)} (unset: fused; off: "
                         "the separate rope_write and attention leaves)")
    return value


def plan_fused(plans: dict, *, geometry=None, **kw) -> dict:
    """{"rope_paged": KernelPlan} unless JENGINE_ATTENTION_ROPE=off, where a leaf composes
    exactly the model's planned `plans["attention"]` and `plans["rope_write"]`; else {} and the
    layer calls the two leaves (logged as a warning where ENV=fused asked explicitly: e.g. auto
    on the CPU, whose XLA attention has no fused form). kw: the model's plan arguments (formats,
    hardware, features); geometry: the attention leaves' (head_dim)."""
    asked = form()
    if asked == "off":
        return {}
    feature = composes(attention=plans["attention"].leaf.impl,
                       rope_write=plans["rope_write"].leaf.impl)
    try:
        return {"rope_paged": plan("attention", "rope_paged", geometry=geometry,
                                   **{**kw, "features": {*kw["features"], feature}})}
    except KernelPlanError as exc:
        log = logger.warning if asked == "fused" else logger.debug
        log("%s: rope_paged not planned: no leaf declares %s (%s)", ENV, feature, exc)
        return {}


@register("attention", "rope_paged", "xla_fixed_order", formats={"bf16", "f32"}, hardware={"any"},
          priority=Priority.PORTABLE, traits={"deterministic": True, "batch_invariant": True},
          features={"batch_invariant", composes(attention="fixed_order", rope_write="xla")})
def rope_paged_portable(q, k, v, cos, sin, kv, page, slot, block_tables, token_req, positions, *,
                        scale):
    q, kv = rope_write(q, k, v, cos, sin, kv, page, slot)
    return paged_fixed_order(q, kv, block_tables, token_req, positions, scale=scale), kv
