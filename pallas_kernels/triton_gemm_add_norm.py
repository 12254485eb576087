"""("linear", "gemm_add_rmsnorm") on the GPU: a projection and the layer boundary after it in one
Triton launch -- o_proj / down_proj, then add + RMSNorm (the unfused boundary's bits) -- for
decode steps of few rows. **Experimental** (pallas_kernels/gemm_epilogues.py): a model plans the
leaf only when JENGINE_GEMM_EPILOGUES names `add_norm`; scripts/gpu_gemm_add_norm.py measures the
launch's bits and time on the H200, `goldens_check_epilogues` the model's bits with it.

Why: an rl-bitwise decode step at one row runs 9 launches per layer, two of them the layer
boundary's add + norm -- 64 launches of ~4.8 µs per step of an 8B model, each with a gap before it
(docs/performance.md, fifteenth session). Here the GEMM's fused split-K reduce
(fixed_tile_gemm_fused_kernel) goes on: the program that closes an output tile counts it in its
row block's counter, and the program that closes a block's last tile norms the block's rows
(pallas_kernels/_triton_gemm_epilogue_kernels.gemm_add_rmsnorm_kernel).

What it computes is, bit for bit, the two launches it replaces (the interpreter checks the logic,
tests/test_triton_gemm_add_norm_interpreter.py; the H200 the bits):

    h = gemm_triton(x, w, bias, out_dtype=residual.dtype)          # on a fused-reduce tile
    normed, new_residual = add_rmsnorm_triton(h, residual, norm_weight, eps=eps, round_sum=True)

round_sum only: the rounded sum's squares are exact in f32, so the sum of squares has the same
bits however the compiler contracts a square into the tree's first adds -- which it does, per
layout, with fp fusion on (the norm kernel's sm_90 PTX has 8 fma.rn.f32 at 8 warps, 16 at 4). The
f32 sum of the fused boundary (round_sum=False) would tie its bits to the launch's warp count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._triton_launch import (INVARIANT, Counters, cdiv, contiguous, jax_launch,
                                           require_cuda_tensors, torch_dtype, torch_launch,
                                           triton_available)
from pallas_kernels.fixed_order import next_pow2
from pallas_kernels.gemm import FORMATS
from pallas_kernels.gemm_epilogues import composes
from pallas_kernels.registry import Priority, register
from pallas_kernels.triton_gemm import _check, _check_tile, _fused, _launches, gemm_triton
from pallas_kernels.triton_gemm_tiles import GemmTile, tile_for
from pallas_kernels.triton_norm import add_rmsnorm_triton


def kernels():
    """The experiments' @triton.jit sources, imported on first use (they import triton)."""
    from pallas_kernels import _triton_gemm_epilogue_kernels

    return _triton_gemm_epilogue_kernels


def _plan(x, w, bias, residual, norm_weight, round_sum, tile):
    """(m, n, tile, grid, constexprs) of one launch; refuses what the kernel cannot compute."""
    m, k, n = _check(x, w, bias, residual.dtype)
    if tuple(residual.shape) != (m, n):
        raise ValueError(f"gemm_add_rmsnorm: residual.shape={tuple(residual.shape)} must be "
                         f"({m}, {n}), the projection's output")
    if tuple(norm_weight.shape) != (n,):
        raise ValueError(f"gemm_add_rmsnorm: norm_weight.shape={tuple(norm_weight.shape)} must "
                         f"be ({n},)")
    if not round_sum:
        raise ValueError("gemm_add_rmsnorm: round_sum=False is not supported: only the rounded "
                         "sum (the unfused boundary) keeps the standalone norm's bits here")
    tile = tile or tile_for(n, k, x.dtype, m)
    _check_tile(k, tile)
    if not (tile.fused_reduce and tile.k_split > 1):
        raise ValueError(f"gemm_add_rmsnorm: tile {tile.describe()} (N={n}, K={k}, M={m}) has no "
                         "fused split-K reduce, which this launch extends: use gemm + "
                         "add_rmsnorm (a table's decode tiles have one)")
    (grid, consts), _ = _launches(m, k, n, x.dtype, bias, tile, "split")
    consts = _fused(consts)  # the fused-reduce kernel's constexprs, which this kernel extends
    block = next_pow2(n)
    consts.update(BLOCK=block, LOG2=block.bit_length() - 1)
    return m, n, tile, grid, consts


# The one launch's last program norms its row block's rows one after another, where the separate
# launch norms every row in a program of its own; so the one launch pays only for the fewest rows.
# An estimate until the H200 measures the crossover (scripts/gpu_gemm_add_norm.py times M = 1..64):
# a row's norm ~2 us inside the program against ~6 us for the separate launch and its gap.
ONE_LAUNCH_MAX_M = 2


def one_launch(x, w, residual, round_sum) -> bool:
    """Whether the fused launch computes this call: the rounded sum (see above), on a launch
    shape with a fused split-K reduce (the table's decode tiles), at no more than
    ONE_LAUNCH_MAX_M rows -- a function of the static M."""
    m, k = x.shape
    tile = tile_for(w.shape[1], k, x.dtype, m)
    return (bool(round_sum) and 0 < m <= ONE_LAUNCH_MAX_M and tile.fused_reduce
            and tile.k_split > 1)


def _counters(m: int, n: int, tile: GemmTile) -> Counters:
    """One per output tile, then one per row block."""
    return Counters(cdiv(m, tile.block_m) * (cdiv(n, tile.block_n) + 1))


def gemm_add_rmsnorm_triton(x, w, bias, residual, norm_weight, *, eps, round_sum=True,
                            tile: GemmTile | None = None):
    """JAX: (normed, new_residual) of norm(x @ w (+ bias) + residual), one launch."""
    m, n, tile, grid, consts = _plan(x, w, bias, residual, norm_weight, round_sum, tile)
    if m == 0:
        return residual, residual
    dtype = jnp.dtype(residual.dtype)
    outs = (jax.ShapeDtypeStruct((tile.k_split, m, n), jnp.float32),  # the chunk partials
            jax.ShapeDtypeStruct((m, n), dtype),  # h: the projection, rounded
            jax.ShapeDtypeStruct((m, n), dtype), jax.ShapeDtypeStruct((m, n), dtype))
    b = w if bias is None else bias
    res = jax_launch(kernels().gemm_add_rmsnorm_kernel,
                     (x, w, b, residual, norm_weight, np.float32(eps), m,
                      _counters(m, n, tile)), outs, grid,
                     num_warps=tile.num_warps, num_stages=tile.num_stages, **consts)
    return res[2], res[3]


def gemm_add_rmsnorm_triton_torch(x, w, bias, residual, norm_weight, *, eps, round_sum=True,
                                  tile: GemmTile | None = None):
    """The same launch on torch CUDA tensors."""
    import torch

    m, n, tile, grid, consts = _plan(x, w, bias, residual, norm_weight, round_sum, tile)
    require_cuda_tensors("gemm_add_rmsnorm_triton_torch", x, w, bias, residual, norm_weight)
    x, w, bias = contiguous(x), contiguous(w), contiguous(bias)
    residual, norm_weight = contiguous(residual), contiguous(norm_weight)
    dtype = torch_dtype(residual.dtype)
    normed = torch.empty((m, n), dtype=dtype, device=x.device)
    new_residual = torch.empty_like(normed)
    if m == 0:
        return normed, new_residual
    parts = torch.empty((tile.k_split, m, n), dtype=torch.float32, device=x.device)
    h = torch.empty_like(normed)
    torch_launch(kernels().gemm_add_rmsnorm_kernel,
                 (x, w, w if bias is None else bias, residual, norm_weight, float(eps), m,
                  _counters(m, n, tile)), (parts, h, normed, new_residual), grid,
                 num_warps=tile.num_warps, num_stages=tile.num_stages, **consts)
    return normed, new_residual


def gemm_add_rmsnorm_leaf(x, w, bias, residual, norm_weight, *, eps, round_sum=False):
    """The family's GPU leaf: the one launch where `one_launch` says so, else the two launches it
    replaces (prefill, and --layer-boundary-norm fused) -- the same bits either way."""
    if one_launch(x, w, residual, round_sum):
        return gemm_add_rmsnorm_triton(x, w, bias, residual, norm_weight, eps=eps)
    h = gemm_triton(x, w, bias, out_dtype=residual.dtype)
    return add_rmsnorm_triton(h, residual, norm_weight, eps=eps, round_sum=round_sum)


if triton_available():
    register("linear", "gemm_add_rmsnorm", "triton_fixed_tile", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED, traits=INVARIANT["traits"],
             features={*INVARIANT["features"],
                       composes(gemm="triton_fixed_tile", add_rmsnorm="triton_fixed_tree")}
             )(gemm_add_rmsnorm_leaf)
