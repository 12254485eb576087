"""Tensor parallelism as the model's forward sees it: the cross-rank steps of one local shard.

The runner (jengine/engine/model_runner.py) runs the whole step under one `jax.shard_map` over
the mesh's "tensor" axis, so every layer computes on its local arrays and only these call sites
talk to other ranks:

    row-parallel sum   o_proj, down_proj   route("all_reduce", sum): the rank-ordered fp32 fold
                       (--tp-batch-invariant   under --batch-invariant-collectives, else lax.psum
                        off)
    column-parallel    o_proj (attn, all)  all-gather of the input's features, one full-K GEMM
    on hidden          down_proj (all)     for this rank's hidden columns, all-gather of them:
                                           no arithmetic across ranks, so the TP1 bits
    embedding lookup   vocab-parallel      each rank looks up its own rows, an all-gather moves
                                           them, the owner's row is selected: no arithmetic
    LM head            vocab-parallel      local logits columns, all-gathered along vocab

A `TensorParallel` is a frozen value held by the model (like its kernel plans): the route of each
call site is decided once, from the launch switches, never from an array's row count.

KV-head replication (tp > kv_heads): k_proj/v_proj are whole on every rank and each rank computes
and caches only the KV head its query heads read (`kv_head_replicas` ranks share one).
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
    column_sites: frozenset[str] = frozenset()  # of "o", "down": column-parallel on hidden
    kv_head_replicas: int = 1                   # ranks sharing one KV head (tp > kv_heads)
    axis: str = TENSOR_AXIS

    def column_parallel(self, site: str) -> bool:
        return site in self.column_sites

    @property
    def row_sum_route(self) -> CollectiveRoute:
        return route("all_reduce", batch_invariant_collectives=self.batch_invariant_collectives,
                     op_kind="sum")

    def row_sum(self, partial):
        """The full output of a row-parallel projection from this rank's partial product."""
        return self.row_sum_route.fn(partial, self.axis)

    def gather_features(self, local):
        """[T, F_local] of this rank -> [T, F]: the ranks' feature slices in rank order (a head-major
        projection's heads, an MLP's columns, a column-parallel GEMM's outputs). Moves bytes only."""
        return lax.all_gather(local, self.axis, axis=local.ndim - 1, tiled=True, to="invarying")

    def kv_head_index(self):
        """The one KV head this rank computes and caches under KV-head replication."""
        return lax.axis_index(self.axis) // self.kv_head_replicas

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


def kv_head_replicas(num_heads: int, kv_heads: int, tp: int) -> int:
    """How many ranks share one KV head: 1 when tp divides kv_heads (each rank owns whole heads),
    tp // kv_heads when kv_heads divides tp (KV-head replication); any other pair is refused, as
    is a tp that does not divide the query heads (a rank holds whole heads)."""
    if num_heads % tp:
        raise ValueError(f"tp_size={tp} does not divide the model's {num_heads} attention heads "
                         "(every rank holds whole heads)")
    if kv_heads % tp == 0:
        return 1
    if tp % kv_heads == 0:
        return tp // kv_heads
    raise ValueError(f"tp_size={tp} and {kv_heads} KV heads: one must divide the other (whole KV "
                     "heads per rank, or whole ranks per KV head)")


# Padding the LM head to whole blocks per rank costs a share of its GEMM; past this share the step
# gathers the logits instead (Llama-3's 128256 at TP8 would need 262144 columns).
MAX_HEAD_PADDING = 1 / 8


def head_padding(vocab_size: int, tp: int, block_width: int | None) -> int:
    """Zero columns appended to a vocab-parallel LM head so every rank holds whole logprob blocks
    (sharding/vocab_parallel.py scores them with no gather): 0 when none are needed, when the order
    has no blocks, or when they would cost more than MAX_HEAD_PADDING of the head."""
    if tp == 1 or block_width is None:
        return 0
    if vocab_size % tp == 0 and (vocab_size // tp) % block_width == 0:
        return 0
    padded = -(-vocab_size // (tp * block_width)) * tp * block_width
    return padded - vocab_size if padded - vocab_size <= MAX_HEAD_PADDING * vocab_size else 0
