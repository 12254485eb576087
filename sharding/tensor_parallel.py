"""Tensor parallelism as the model's forward sees it: the cross-rank steps of one local shard.

The runner (jengine/engine/model_runner.py) runs the whole step under one `jax.shard_map` over
the mesh's "tensor" axis, so every layer computes on its local arrays and only these call sites
talk to other ranks:

    row-parallel sum   o_proj, down_proj   route("all_reduce", sum): the rank-ordered fp32 fold
                                           under --batch-invariant-collectives, else lax.psum
    embedding lookup   vocab-parallel      each rank looks up its own rows, an all-gather moves
                                           them, the owner's row is selected: no arithmetic
    LM head            vocab-parallel      local logits columns, all-gathered along vocab

A `TensorParallel` is a frozen value held by the model (like its kernel plans): the route of each
call site is decided once, from the launch switch, never from an array's row count.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from sharding.collectives import CollectiveRoute, route
from sharding.mesh import TENSOR_AXIS


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    size: int
    batch_invariant_collectives: bool
    axis: str = TENSOR_AXIS

    @property
    def row_sum_route(self) -> CollectiveRoute:
        return route("all_reduce", batch_invariant_collectives=self.batch_invariant_collectives,
                     op_kind="sum")

    def row_sum(self, partial):
        """The full output of a row-parallel projection from this rank's partial product."""
        return self.row_sum_route.fn(partial, self.axis)

    def embed(self, local_table, ids):
        """Rows `ids` [T] of the vocab-parallel table (this rank holds rows
        [rank * V_local, (rank + 1) * V_local)): [T, H], the same bytes on every rank."""
        v_local = local_table.shape[0]
        rank = lax.axis_index(self.axis)
        local = local_table[jnp.clip(ids - rank * v_local, 0, v_local - 1)]
        parts = lax.all_gather(local, self.axis, axis=0, tiled=False, to="invarying")  # [W, T, H]
        return parts[ids // v_local, jnp.arange(ids.shape[0])]

    def gather_vocab(self, local_logits):
        """[n, V_local] columns of this rank -> [n, V], vocabulary order (rank-major)."""
        return lax.all_gather(local_logits, self.axis, axis=local_logits.ndim - 1, tiled=True,
                              to="invarying")
