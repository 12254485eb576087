"""A projection: weight held [in, out] (HF stores [out, in]) and an optional bias, through the
model's planned GEMM leaf."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flax import nnx

from jengine.models.layers.param import ParamSpec


class Linear(nnx.Module):
    @staticmethod
    def specs(in_features: int, out_features: int, axes: tuple[str, str], *, bias: bool,
              dtype) -> dict[str, ParamSpec]:
        specs = {"weight": ParamSpec((in_features, out_features), dtype, axes, transpose=True)}
        if bias:
            specs["bias"] = ParamSpec((out_features,), dtype, axes[1:])
        return specs

    def __init__(self, specs: dict, source):
        self.weight = nnx.Param(source.place(specs["weight"]))
        self.bias = nnx.Param(source.place(specs["bias"])) if "bias" in specs else None

    def __call__(self, kern, x, *, out_dtype, tp=None, site: str | None = None):
        """tp, site: a reduction site ("o", "down") of a tensor-parallel model, inside shard_map.
        x holds this rank's slice of the input features. Row-parallel: the local product is a
        partial, summed across ranks before the bias is added once. Column-parallel on hidden:
        the input is gathered whole and this rank computes its output columns with the full K,
        so each element is the one-device value."""
        bias = None if self.bias is None else self.bias[...]
        if tp is None:
            return kern.gemm(x, self.weight[...], bias, out_dtype=out_dtype)
        if tp.column_parallel(site):
            y = kern.gemm(tp.gather_features(x), self.weight[...], bias, out_dtype=out_dtype)
            return tp.gather_features(y)
        y = tp.row_sum(kern.gemm(x, self.weight[...], None, out_dtype=out_dtype))
        return y if bias is None else y + bias


def linears(kern, x, projections: tuple[Linear, ...], *, out_dtype):
    """Several projections of one x (q/k/v, gate/up) as one grouped GEMM where the leaf has one;
    each output's bits are those of its own Linear call. Biases are all or none."""
    biases = None
    if projections[0].bias is not None:
        biases = tuple(p.bias[...] for p in projections)
    return kern.gemm_group(x, tuple(p.weight[...] for p in projections), biases,
                           out_dtype=out_dtype)


@dataclass(frozen=True)
class PendingProjection:
    """A projection left for the layer boundary that reads it (o_proj, down_proj), which runs it
    with its add + norm as one leaf (RMSNorm.add_projection: gemm_add_rmsnorm). A layer returns
    one only when asked (`pending=True`), which the body does only where the model planned that
    leaf."""

    linear: Linear
    x: Any  # the projection's input [T, K]
