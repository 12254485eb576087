"""RMSNorm's weight; the normalisation itself is the model's planned norm leaf (alone, or fused
with the residual add)."""

from __future__ import annotations

from flax import nnx

from jengine.models.layers.param import ParamSpec


class RMSNorm(nnx.Module):
    @staticmethod
    def specs(size: int, axis: str, *, dtype) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec((size,), dtype, (axis,))}

    def __init__(self, specs: dict, source):
        self.weight = nnx.Param(source.place(specs["weight"]))

    def __call__(self, kern, x, *, eps):
        return kern.rmsnorm(x, self.weight[...], eps=eps)

    def add(self, kern, x, residual, *, eps, round_sum=False):
        """(norm(x + residual), x + residual) in one fused leaf; round_sum: the norm reads the
        rounded sum (the bits of the add in x's dtype, then the norm: the `unfused` boundary)."""
        return kern.add_rmsnorm(x, residual, self.weight[...], eps=eps, round_sum=round_sum)

    def add_projection(self, kern, pending, residual, *, eps, round_sum=False):
        """`add` of a projection not yet computed (layers/linear.py: PendingProjection): the
        projection, rounded to residual's dtype, and this boundary in one gemm_add_rmsnorm leaf,
        with the bits of the Linear call followed by `add`."""
        lin = pending.linear
        bias = None if lin.bias is None else lin.bias[...]
        return kern.gemm_add_rmsnorm(pending.x, lin.weight[...], bias, residual, self.weight[...],
                                     eps=eps, round_sum=round_sum)
