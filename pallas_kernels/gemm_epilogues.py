"""("linear", "gemm_add_rmsnorm") and ("linear", "gemm_swiglu"): a projection and the step after
it as one operator, so a GPU can run them as one launch.

``gemm_add_rmsnorm(x, w, bias, residual, norm_weight, *, eps, round_sum=False)`` is o_proj /
down_proj and the layer boundary after it: ``add_rmsnorm(gemm(x, w, bias), residual, ...)`` ->
(normed, new residual), the projection rounded to residual's dtype first.
``gemm_swiglu(x, w_gate, w_up, *, out_dtype)`` is SwiGLU before down_proj: ``silu(gate, times=up)``
of the grouped gate/up projections.

**Experimental, off by default.** A leaf of these families gives, bit for bit, the leaves it
composes: it declares them in its ``composes`` trait, and a model plans it only where they are the
very leaves it planned for the separate calls (dense.ModelKernels), so planning one can never move
a bit -- the Triton forms (triton_gemm_add_norm.py, triton_gemm_swiglu.py) are checked against
their two launches under the interpreter, and the H200 goldens run with them
(`goldens_check_epilogues`). Whether they are faster is not measured yet, so a model plans them
only when ``JENGINE_GEMM_EPILOGUES`` names them (`requested`); the portable leaves here exist so
that the dense body's fused path is tested on every machine.
"""

from __future__ import annotations

import os

from pallas_kernels.activation import silu
from pallas_kernels.gemm import FORMATS, gemm_fixed_order, gemm_group_fixed_order
from pallas_kernels.registry import Priority, declare_family, register
from pallas_kernels.rmsnorm import add_rmsnorm

ENV = "JENGINE_GEMM_EPILOGUES"
KINDS = ("add_norm", "swiglu")


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
    unknown = sorted(names - set(KINDS))
    if unknown:
        raise ValueError(f"{ENV}={raw!r}: unknown {unknown}; expected a comma-separated subset of "
                         f"{list(KINDS)}")
    return names


def composes(**impls: str) -> dict:
    """The trait a fused leaf declares and a model's plan asks for: the impl of each separate
    leaf whose bits it gives ({"gemm": ..., "add_rmsnorm": ...})."""
    return {"composes": dict(impls)}


_PORTABLE = dict(formats=FORMATS, hardware={"any"}, priority=Priority.PORTABLE,
                 features={"batch_invariant"})


@register("linear", "gemm_add_rmsnorm", "fixed_order",
          traits={"deterministic": True, "batch_invariant": True,
                  **composes(gemm="fixed_order", add_rmsnorm="fixed_order")}, **_PORTABLE)
def gemm_add_rmsnorm_fixed_order(x, w, bias, residual, norm_weight, *, eps, round_sum=False):
    h = gemm_fixed_order(x, w, bias, out_dtype=residual.dtype)
    return add_rmsnorm(h, residual, norm_weight, eps=eps, round_sum=round_sum)


@register("linear", "gemm_swiglu", "fixed_order",
          traits={"deterministic": True, "batch_invariant": True,
                  **composes(gemm_group="fixed_order", silu="elementwise")}, **_PORTABLE)
def gemm_swiglu_fixed_order(x, w_gate, w_up, *, out_dtype):
    gate, up = gemm_group_fixed_order(x, (w_gate, w_up), out_dtype=out_dtype)
    return silu(gate, times=up)
