"""Collectives under `jax.shard_map`, and the one static decision of which to use.

Spec, "The hierarchy" (collectives.deterministic, batch_invariant_collectives): under a bitwise
envelope every cross-rank SUM is data movement plus a fold over ranks 0..W-1, left to right, in
fp32, rounded once to the input dtype:

    all-reduce     = all_gather(tiled=False) + fold   (W x the traffic of a ring all-reduce)
    reduce-scatter = all_to_all              + fold   (the same traffic as a reduce-scatter)

Why not psum: StableHLO's all_reduce uses an "implementation-defined" order and JAX documents
none; NCCL's order follows algorithm, protocol, channel count and message size, so a row's sum
can change with the batch it travels in. The fold's order is written in the program: the value
of an element depends on that element's W partials and nothing else, so it cannot depend on the
row count. MAX/MIN are exact in any order and stay on the native collective; gathers and
all-to-alls move bytes without arithmetic and need no fold.

Signed zeros: the fold starts from +0.0, so a sum whose every term is -0.0 comes out +0.0 (the
spec's fold does the same). Every other result equals the fold started from the first term.

These functions must be called inside `jax.shard_map` over a mesh that has `axis_name`; rank r is
position r along that mesh axis (sharding.mesh fixes which device that is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax

FOLD_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _check_foldable(x, where: str) -> None:
    # A float64 payload would lose bits in an fp32 fold; integer sums are exact in any order.
    if jnp.dtype(x.dtype) not in FOLD_DTYPES:
        raise TypeError(f"{where}: x.dtype={x.dtype} is not one of bfloat16, float16, float32 "
                        "(the fold accumulates in float32)")


def rank_order_fold(parts):
    """Sum `parts` [W, ...] over axis 0 as ((0 + p0) + p1) + ... + p(W-1), in float32."""
    acc = parts[0].astype(jnp.float32)
    for rank in range(1, parts.shape[0]):  # a static loop: the order is in the program
        acc = acc + parts[rank].astype(jnp.float32)
    # Starting from +0.0 only changes an all-(-0.0) sum to +0.0. Written as `0.0 + p0`, XLA's
    # algebraic simplifier deletes it (measured), so the sign is fixed here; no nonzero changes.
    return jnp.where(acc == 0, jnp.zeros_like(acc), acc)


def ordered_all_reduce(x, axis_name):
    """Sum of `x` over the ranks of `axis_name`, the same bits on every rank and every batch."""
    _check_foldable(x, "ordered_all_reduce")
    # to="invarying": every rank holds the same gathered block, so the result is typed as
    # replicated over axis_name (as psum's is) and out_specs may leave that axis out.
    parts = lax.all_gather(x, axis_name, axis=0, tiled=False, to="invarying")  # [W, *x.shape]
    return rank_order_fold(parts).astype(x.dtype)


def ordered_reduce_scatter(x, axis_name, *, scatter_dimension: int = 0):
    """Rank r gets block r (along `scatter_dimension`) of the sum over ranks: psum_scatter's
    tiled result, folded in rank order."""
    _check_foldable(x, "ordered_reduce_scatter")
    world = lax.axis_size(axis_name)
    d = scatter_dimension % x.ndim
    if x.shape[d] % world:
        raise ValueError(f"ordered_reduce_scatter: x.shape[{d}]={x.shape[d]} is not a multiple "
                         f"of the {axis_name!r} axis size {world}")
    blocks = x.reshape(x.shape[:d] + (world, x.shape[d] // world) + x.shape[d + 1:])
    blocks = jnp.moveaxis(blocks, d, 0)  # [W (destination rank), ...]
    # tiled=False: the destination axis is split off and a new leading axis indexes the source
    # rank, so received[s] is rank s's partial of this rank's block.
    received = lax.all_to_all(blocks, axis_name, split_axis=0, concat_axis=0, tiled=False)
    return rank_order_fold(received).astype(x.dtype)


def native_all_reduce(x, axis_name):
    return lax.psum(x, axis_name)


def native_reduce_scatter(x, axis_name, *, scatter_dimension: int = 0):
    return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=True)


# -- the route -----------------------------------------------------------------------------------

COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
OP_KINDS = {
    "all_reduce": ("sum", "max", "min"),
    "reduce_scatter": ("sum",),
    "all_gather": ("data",),  # data movement: bytes are permuted, nothing is added
    "all_to_all": ("data",),
}


@dataclasses.dataclass(frozen=True)
class CollectiveRoute:
    op: str
    op_kind: str
    path: str  # "ordered_fold" or "native"
    fn: Callable
    why: str


def route(op: str, *, batch_invariant_collectives: bool, op_kind: str) -> CollectiveRoute:
    """The one decision for a collective call site (spec: AutoBackend.route).

    It reads only static properties of the call site -- which collective, which reduction, the
    launch switch -- and takes no array, so a site cannot change route with its row count.
    """
    if op not in COLLECTIVE_OPS:
        raise ValueError(f"route: op={op!r} is not one of {COLLECTIVE_OPS}")
    if op_kind not in OP_KINDS[op]:
        raise ValueError(f"route: op_kind={op_kind!r} is not valid for {op}; use one of "
                         f"{OP_KINDS[op]}")
    if not isinstance(batch_invariant_collectives, bool):
        raise TypeError(f"route: batch_invariant_collectives={batch_invariant_collectives!r} "
                        "must be a bool (the resolved launch switch, not None)")

    def native(fn, why):
        return CollectiveRoute(op, op_kind, "native", fn, why)

    if op == "all_gather":
        return native(lax.all_gather, "data movement: nothing to fold")
    if op == "all_to_all":
        return native(lax.all_to_all, "data movement: nothing to fold")
    if op_kind == "max":
        return native(lax.pmax, "max is exact in any order")
    if op_kind == "min":
        return native(lax.pmin, "min is exact in any order")
    ordered, plain = {"all_reduce": (ordered_all_reduce, native_all_reduce),
                      "reduce_scatter": (ordered_reduce_scatter, native_reduce_scatter)}[op]
    if batch_invariant_collectives:
        return CollectiveRoute(op, op_kind, "ordered_fold", ordered,
                               "batch_invariant_collectives: fixed rank-order fp32 fold")
    return native(plain, "auto: the backend's own order (run-stable at best, not batch-invariant)")
