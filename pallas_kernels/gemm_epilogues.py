"""("linear", "gemm_add_rmsnorm") and ("linear", "gemm_swiglu"): a projection and the step after
it as one operator, so a GPU can run them as one launch.

``gemm_add_rmsnorm(x, w, bias, residual, norm_weight, *, eps, round_sum=False)`` is o_proj /
down_proj and the layer boundary after it: ``add_rmsnorm(gemm(x, w, bias), residual, ...)`` ->
(normed, new residual), the projection rounded to residual's dtype first.
``gemm_swiglu(x, w_gate, w_up, *, out_dtype)`` is SwiGLU before down_proj: ``silu(gate, times=up)``
of the grouped gate/up projections.

**Experimental, off by default.** A leaf of these families gives, bit for bit, the leaves it
composes, and names them in a feature (`composes`). Features are what the registry guarantees with
(a buyer-required subset test: a leaf silent on one is never eligible), so a model requiring the
feature of exactly the separate leaves it planned (`plan_fused`) cannot get a fused leaf that
would move a bit. The Triton forms (triton_gemm_add_norm.py,
triton_gemm_swiglu.py) are checked against their two launches under the interpreter, and on the
H200 every golden kept its bits with them planned; neither was faster in the model there
(docs/performance.md, eighteenth session), so a model plans them only when
``JENGINE_GEMM_EPILOGUES`` names them (`requested`). The SwiGLU launch has since been rebuilt on
the grouped launch's programs (twenty-fifth session; not measured on a GPU yet). The portable
leaves here exist so that the dense body's fused path is tested on every machine.
"""

from __future__ import annotations

import logging
import os

from pallas_kernels.activation import silu
from pallas_kernels.gemm import FORMATS, gemm_fixed_order, gemm_group_fixed_order
from pallas_kernels.registry import KernelPlanError, Priority, declare_family, plan, register
from pallas_kernels.rmsnorm import add_rmsnorm

logger = logging.getLogger(__name__)

ENV = "JENGINE_GEMM_EPILOGUES"
# What JENGINE_GEMM_EPILOGUES may name -> (the fused family, the separate families it composes).
FAMILIES = {"add_norm": ("gemm_add_rmsnorm", ("gemm", "add_rmsnorm")),
            "swiglu": ("gemm_swiglu", ("gemm_group", "silu"))}


def _gemm_add_rmsnorm_signature(x, w, bias, residual, norm_weight, *, eps, round_sum=False):
    """x[M, K], w[K, N], bias[N]|None, residual[M, N], norm_weight[N] -> (normed, new residual)."""


def _gemm_swiglu_signature(x, w_gate, w_up, *, out_dtype):
    """x[M, K], w_gate and w_up [K, N] -> silu(x @ w_gate) * (x @ w_up) [M, N] in out_dtype."""


declare_family("linear", "gemm_add_rmsnorm", _gemm_add_rmsnorm_signature)
declare_family("linear", "gemm_swiglu", _gemm_swiglu_signature)


def requested() -> frozenset[str]:
    """The epilogues JENGINE_GEMM_EPILOGUES asks a model to plan (comma-separated KINDS; unset or
    empty: none). A name it does not know is an error naming the variable and the value."""
    raw = os.environ.get(ENV, "")
    names = frozenset(part.strip() for part in raw.split(",") if part.strip())
    unknown = sorted(names - set(FAMILIES))
    if unknown:
        raise ValueError(f"{ENV}={raw!r}: unknown {unknown}; expected a comma-separated subset of "
                         f"{list(FAMILIES)}")
    return names


def composes(**impls: str) -> str:
    """The feature a fused leaf declares and a model's plan requires: the impl of each separate
    leaf whose bits it gives, e.g. "composes:add_rmsnorm=fixed_order,gemm=fixed_order"."""
    return "composes:" + ",".join(f"{family}={impl}" for family, impl in sorted(impls.items()))


def plan_fused(plans: dict, **kw) -> dict:
    """{field: KernelPlan} of the fused leaves JENGINE_GEMM_EPILOGUES asks for, each the leaf that
    composes exactly the separate leaves in `plans` ({"gemm": KernelPlan, ...}); kw: the model's
    plan arguments (formats, hardware, features). A request no leaf can serve under these plans
    (auto's XLA GEMM has no fused form) is logged and left unplanned: the body then calls the
    separate leaves, as without it."""
    out = {}
    for kind in sorted(requested()):
        name, parts = FAMILIES[kind]
        feature = composes(**{part: plans[part].leaf.impl for part in parts})
        try:
            out[name] = plan("linear", name, **{**kw, "features": {*kw["features"], feature}})
        except KernelPlanError as exc:
            logger.warning("%s=%s: %s not planned: no leaf declares %s (%s)", ENV, kind, name,
                           feature, exc)
    return out


_TRAITS = {"deterministic": True, "batch_invariant": True}
_PORTABLE = dict(formats=FORMATS, hardware={"any"}, priority=Priority.PORTABLE, traits=_TRAITS)


@register("linear", "gemm_add_rmsnorm", "fixed_order", **_PORTABLE, features={
    "batch_invariant", composes(gemm="fixed_order", add_rmsnorm="fixed_order")})
def gemm_add_rmsnorm_fixed_order(x, w, bias, residual, norm_weight, *, eps, round_sum=False):
    h = gemm_fixed_order(x, w, bias, out_dtype=residual.dtype)
    return add_rmsnorm(h, residual, norm_weight, eps=eps, round_sum=round_sum)


@register("linear", "gemm_swiglu", "fixed_order", **_PORTABLE, features={
    "batch_invariant", composes(gemm_group="fixed_order", silu="elementwise")})
def gemm_swiglu_fixed_order(x, w_gate, w_up, *, out_dtype):
    gate, up = gemm_group_fixed_order(x, (w_gate, w_up), out_dtype=out_dtype)
    return silu(gate, times=up)
