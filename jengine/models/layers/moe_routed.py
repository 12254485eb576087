"""Routed expert compute: each (token, slot) pair through its own expert only, with the bits the
dense every-expert-on-every-row path gives that pair.

For pair (t, s) with expert e = ids[t, s] and routing weight w = weights[t, s]:

    g   = gemm(x[t], gate_e),  u = gemm(x[t], up_e)          model dtype
    a   = silu(g) * u                                          model dtype (as moe.py)
    a_w = (a as f32 * w) rounded once to the model dtype       the weight INSIDE the activation
    y   = gemm(a_w, down_e)                                    model dtype

The spec's slot form places the routing weight inside the activation, before down_proj, as a
grouped-MLP trainer does; the combine (slot order, f32) stays the caller's. The GEMMs are the
("moe", "grouped_gemm") plan over the expert-sorted, tile-padded rows of `plan_expert_tiles`
(pallas_kernels/moe_grouped_gemm.py): each row has the bits of the gemm leaf of the same impl on
that row, so every pair's output equals the dense path's whatever the routing; the gathers into
and out of the layout move bytes only, and padding rows are zeros through every step.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.moe_grouped_gemm import (EMPTY_TILE, block_rows_for, num_tiles,
                                              plan_expert_tiles)


def routed_expert_outputs(kern, x, ids, weights, gate_w, up_w, down_w, *, dtype,
                          block_rows: int | None = None, foreign: bool = False):
    """x [T, H], ids int32[T, k], weights f32[T, k], gate_w / up_w [E, H, I], down_w [E, I, H]
    -> [T, k, H] in `dtype`: slot s of token t is expert ids[t, s]'s output for row t, scaled
    inside the activation by weights[t, s].

    kern: a kernel set with `grouped_gemm` (a ("moe", "grouped_gemm") plan) and `silu`.
    block_rows: the layout's row block; by default the one every grouped leaf accepts for these
    widths (`expert_block_rows`).
    foreign: ids may hold E (= gate_w.shape[0]) for a pair no expert here computes (an empty row of
    an expert-parallel buffer, an identity expert's slot); such pairs land in empty tiles (no GEMM
    work) and their slots are zeros.
    """
    t, h = x.shape
    k = ids.shape[1]
    num_experts, _, inter = gate_w.shape
    if block_rows is None:
        block_rows = expert_block_rows(inter, h, dtype)
    order, tile_expert, row_of_pair = plan_expert_tiles(ids, num_experts + foreign, block_rows)
    if foreign:  # the extra "expert" E computes nothing: its tiles do no work
        tile_expert = jnp.where(tile_expert == num_experts, EMPTY_TILE, tile_expert)
    # Padding rows carry pair index T*k: out of range, so the gathers fill them with zeros.
    rows_x = x.at[order // k].get(mode="fill", fill_value=0)
    rows_w = weights.reshape(t * k).astype(jnp.float32).at[order].get(mode="fill", fill_value=0)

    def grouped(a, w):
        return kern.grouped_gemm(a, w, tile_expert, block_rows=block_rows, out_dtype=dtype)

    act = kern.silu(grouped(rows_x, gate_w), times=grouped(rows_x, up_w))
    scaled = (act.astype(jnp.float32) * rows_w[:, None]).astype(dtype)
    return grouped(scaled, down_w)[row_of_pair]


def layout_rows(tokens: int, k: int, num_experts: int, inter: int, hidden: int, dtype, *,
                foreign: bool = True) -> int:
    """The rows every grouped GEMM of `routed_expert_outputs` runs for a step of `tokens` rows
    (padding included) over `num_experts` experts of width `inter`: static, sized for any routing
    of the tokens x k pairs, so a bs 1 step's 16-row bucket holds 128 tiles of 64 rows at
    Qwen3-30B-A3B's widths for its 8 pairs' 8 (what the bench reports next to the pairs)."""
    block_rows = expert_block_rows(inter, hidden, dtype)
    return num_tiles(tokens * k, num_experts + foreign, block_rows) * block_rows


def expert_block_rows(inter: int, hidden: int, dtype) -> int:
    """The layout's row block of experts of width `inter` on `hidden`: the one every grouped leaf
    accepts for their gate/up ([hidden -> inter]) and down_proj ([inter -> hidden]) GEMMs."""
    return block_rows_for(((inter, hidden), (hidden, inter)), dtype)
