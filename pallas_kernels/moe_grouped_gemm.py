"""("moe", "grouped_gemm"): routed expert GEMMs whose rows keep the bits of the dense gemm leaf.

A MoE layer sends each (token, slot) pair to one expert. Computing every expert on every token row
costs E/k times the routed FLOPs (16x for 128 experts, top-8); routing only the pairs is the
obvious fix, and the spec's requirement on it is that **a row's bits never depend on how many
tokens its expert got**. This family meets it by construction: the rows come sorted by expert and
padded so that each tile of `block_rows` rows belongs to exactly one expert, and each row is then
computed by the same per-row reduction the batch-invariant ("linear", "gemm") leaf of the same
impl runs. Group sizes change how many tiles (and launches) there are, never a row's reduction.

    grouped_gemm(x [R, K], w [E, K, N], tile_expert int32[R // block_rows], *, block_rows,
                 out_dtype) -> [R, N]
    row r = gemm(x[r], w[tile_expert[r // block_rows]]), f32 accumulation, one rounding;
    a tile with tile_expert = -1 holds no pair: its rows are zeros out, whatever x holds.

Each leaf has the impl name, formats, hardware, priority, traits and features of its gemm leaf
(one request plans corresponding leaves) and the row bits of that leaf:

* ``fixed_order`` -- a sequential map over the tiles, each calling the fixed-order row GEMM
  (`sequential_dot`, the `gemm_fixed_order` body) on that tile's rows and its expert's [K, N]
  slice; never a [tiles, K, N] gather.
* ``triton_fixed_tile`` (pallas_kernels/triton_moe_grouped_gemm.py, GPU) -- one launch whose
  programs read their tile's expert and run the dense Triton GEMM's tile body with the dense
  leaf's tile for (N, K, dtype).

The layout (`plan_expert_tiles`) is a pure function of the routed ids and static shapes; moving
rows into it and back is a gather (bytes only), so the layout can never change a value.
`block_rows_for` gives the row block every leaf accepts for a layer's GEMMs.
"""

from __future__ import annotations

from typing import Iterable

import jax.numpy as jnp
from jax import lax

from pallas_kernels._twin import torch_twin
from pallas_kernels.fixed_order import sequential_dot
from pallas_kernels.gemm import FIXED_ORDER
from pallas_kernels.registry import declare_family, register
from pallas_kernels.triton_gemm_tiles import tile_for


def _grouped_gemm_signature(x, w, tile_expert, *, block_rows, out_dtype):
    """x[R, K], w[E, K, N] (one dtype), tile_expert int32[R // block_rows] (-1: an empty tile) ->
    [R, N] in out_dtype: row r = x[r] @ w[tile_expert[r // block_rows]], f32 accumulation."""


declare_family("moe", "grouped_gemm", _grouped_gemm_signature)

EMPTY_TILE = -1  # tile_expert of a tile past the last routed pair


def check_grouped(x, w, tile_expert, block_rows: int) -> tuple[int, int, int, int]:
    """(R, K, N, E) of a grouped call, or ValueError naming the field and value."""
    if len(x.shape) != 2 or len(w.shape) != 3:
        raise ValueError(f"grouped_gemm: x must be [R, K] and w [E, K, N], got "
                         f"x.shape={tuple(x.shape)}, w.shape={tuple(w.shape)}")
    r, k = x.shape
    e, wk, n = w.shape
    if wk != k:
        raise ValueError(f"grouped_gemm: x.shape[1]={k} does not match w.shape[1]={wk}")
    if not isinstance(block_rows, int) or block_rows < 1 or r % block_rows:
        raise ValueError(f"grouped_gemm: block_rows={block_rows!r} must be a positive int "
                         f"dividing R={r}")
    if tuple(tile_expert.shape) != (r // block_rows,):
        raise ValueError(f"grouped_gemm: tile_expert.shape={tuple(tile_expert.shape)} must be "
                         f"(R // block_rows,) = ({r // block_rows},)")
    return r, k, n, e


@register("moe", "grouped_gemm", "fixed_order", **FIXED_ORDER)
def grouped_gemm_fixed_order(x, w, tile_expert, *, block_rows, out_dtype):
    r, k, n, _ = check_grouped(x, w, tile_expert, block_rows)
    tiles = x.reshape(r // block_rows, block_rows, k)

    def one_tile(args):
        rows, expert = args
        # An empty tile's expert id is -1: its rows are zeros, never a clamped expert's garbage.
        return lax.cond(
            expert < 0,
            lambda: jnp.zeros((block_rows, n), out_dtype),
            lambda: sequential_dot(rows, lax.dynamic_index_in_dim(w, expert, keepdims=False))
            .astype(out_dtype))

    return lax.map(one_tile, (tiles, tile_expert.astype(jnp.int32))).reshape(r, n)


# The trainer-side twin: the same compiled program, called from torch (pallas_kernels/_twin.py).
grouped_gemm_fixed_order_torch = torch_twin(grouped_gemm_fixed_order,
                                            static_argnames=("block_rows", "out_dtype"))


# -- the layout ------------------------------------------------------------------------------------


def num_tiles(pairs: int, num_experts: int, block_rows: int) -> int:
    """The static tile count that holds any routing of `pairs` pairs over `num_experts` experts:
    sum over the m used experts of ceil(n_e / BM) <= (pairs + m (BM - 1)) / BM, m <= min(E, pairs).
    At T = 1, k = 8 that is 8 tiles, one per routed expert."""
    return (pairs + min(num_experts, pairs) * (block_rows - 1)) // block_rows


def plan_expert_tiles(ids, num_experts: int, block_rows: int):
    """The row layout of one routed step, host-free (jittable, static shapes).

    ids int32[T, k] in [0, num_experts) -> (order int32[R], tile_expert int32[R // block_rows],
    row_of_pair int32[T, k]), R = num_tiles(T k, E, BM) * BM:
      order[r]          the pair (t * k + s) whose row sits at r, or T * k on a padding row;
      tile_expert[j]    the expert of rows j BM .. (j + 1) BM - 1, or EMPTY_TILE past the last;
      row_of_pair[t, s] the row holding pair (t, s).
    Experts take consecutive tiles in id order; within an expert, pairs keep their flat order.
    """
    t, k = ids.shape
    pairs = t * k
    tiles = num_tiles(pairs, num_experts, block_rows)
    flat = ids.reshape(pairs).astype(jnp.int32)
    counts = jnp.zeros(num_experts, jnp.int32).at[flat].add(1)
    expert_tiles = (counts + block_rows - 1) // block_rows
    tile_end = jnp.cumsum(expert_tiles)                      # inclusive
    first_row = (tile_end - expert_tiles) * block_rows        # of each expert's first tile
    first_pair = jnp.cumsum(counts) - counts                  # in the expert-sorted pair order
    by_expert = jnp.argsort(flat, stable=True)                # sorted position -> pair
    expert = flat[by_expert]
    row = first_row[expert] + jnp.arange(pairs, dtype=jnp.int32) - first_pair[expert]
    order = jnp.full(tiles * block_rows, pairs, jnp.int32).at[row].set(by_expert.astype(jnp.int32))
    row_of_pair = jnp.zeros(pairs, jnp.int32).at[by_expert].set(row).reshape(t, k)
    j = jnp.arange(tiles, dtype=jnp.int32)
    owner = jnp.searchsorted(tile_end, j, side="right").astype(jnp.int32)
    tile_expert = jnp.where(j < tile_end[-1], owner, EMPTY_TILE)
    return order, tile_expert, row_of_pair


def block_rows_for(shapes: Iterable[tuple[int, int]], dtype) -> int:
    """The row block of a layer whose grouped GEMMs have these (N, K): the largest block_m the
    Triton tiles give them (triton_gemm_tiles; powers of two, so a multiple of every other). The
    Triton leaf needs a multiple of its tile's block_m (a program's rows then share one expert);
    the fixed-order leaf takes any block. One layout on every backend: 64 for Qwen3-30B-A3B in
    bf16, 32 in f32."""
    return max(tile_for(n, k, dtype).block_m for n, k in shapes)
