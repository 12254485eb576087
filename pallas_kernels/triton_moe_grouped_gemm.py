"""("moe", "grouped_gemm") on the GPU: the routed experts' GEMMs as one fixed-tile Triton launch
per projection, each row with the bits of the dense Triton gemm leaf on that row.

Signature (pallas_kernels/moe_grouped_gemm.py): ``fn(x[R, K], w[E, K, N], tile_expert
int32[R // block_rows], *, block_rows, out_dtype) -> [R, N]``; rows sorted by expert, each block of
`block_rows` rows one expert's (-1: empty, zeros out).

Why a row's bits equal `gemm_triton`'s (pallas_kernels/triton_gemm.py): the tile is the dense
leaf's, `tile_for(N, K, dtype)` -- the same BM, BN, BK, k_split, warps and stages -- and each
program runs the dense kernel's tile body (`_gemm_tile`) on its expert's [K, N] weight, so a row
meets the same K chunks, the same BK steps and the same MMA as in the dense launch. Group sizes
change how many tiles are launched, never a row's reduction. block_rows must be a multiple of the
tile's block_m (a program's rows then belong to one expert): `block_rows_for` gives one. Both
schedules (serial, split + gemm_reduce_kernel) give the same bits, as for the dense leaf.

`grouped_gemm_triton` is the JAX leaf; `grouped_gemm_triton_torch` launches the very same kernel on
torch CUDA tensors, for the trainer. Registration happens only where triton and jax-triton import.
CPU check: tests/test_triton_grouped_gemm_interpreter.py (Triton's interpreter: the logic);
H200 check: scripts/gpu_grouped_gemm.py (the bits, and routed vs dense timings).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._triton_launch import (INVARIANT, contiguous, dtype_name, jax_launch,
                                           require_cuda_tensors, torch_dtype,
                                           torch_launch, triton_available)
from pallas_kernels.gemm import FORMATS
from pallas_kernels.moe_grouped_gemm import check_grouped
from pallas_kernels.registry import Priority, register
from pallas_kernels.triton_gemm import _check_tile, _launches, kernels, schedule_for
from pallas_kernels.triton_gemm_tiles import GemmTile, tile_for


def _plan(x, w, tile_expert, block_rows, out_dtype, tile, schedule):
    """(R, N, tile, (grid, constexprs), reduce launch or None) of one grouped call."""
    r, k, n, _ = check_grouped(x, w, tile_expert, block_rows)
    xd, wd = dtype_name(x.dtype), dtype_name(w.dtype)
    if xd not in FORMATS or xd != wd:
        raise ValueError(f"grouped_gemm: x.dtype={xd} and w.dtype={wd} must be equal and one of "
                         f"{sorted(FORMATS)}")
    if dtype_name(out_dtype) not in ("bf16", "f32", "f16"):
        raise ValueError(f"grouped_gemm: out_dtype={out_dtype} must be bf16, f16 or f32")
    tile = tile or tile_for(n, k, x.dtype)  # the dense leaf's tile for this (N, K, dtype)
    _check_tile(k, tile)
    if block_rows % tile.block_m:
        raise ValueError(f"grouped_gemm: block_rows={block_rows} must be a multiple of the tile's "
                         f"block_m={tile.block_m} ({tile.describe()}), so that a program's rows "
                         "share one expert (moe_grouped_gemm.block_rows_for gives one)")
    (grid, consts), reduce = _launches(r, k, n, x.dtype, None, tile,
                                       schedule_for(r, n, tile, schedule))
    return r, n, tile, (grid, dict(consts, BLOCK_ROWS=block_rows)), reduce


def grouped_gemm_triton(x, w, tile_expert, *, block_rows, out_dtype, tile: GemmTile | None = None,
                        schedule: str | None = None):
    """JAX leaf: one launch (+ the split schedule's reduce) through jax-triton."""
    r, n, tile, (grid, consts), reduce = _plan(x, w, tile_expert, block_rows, out_dtype, tile,
                                               schedule)
    if r == 0:
        return jnp.zeros((0, n), out_dtype)
    inputs = (x, w, tile_expert.astype(jnp.int32), r)
    warps = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    out = jax.ShapeDtypeStruct((r, n), jnp.dtype(out_dtype))
    if reduce is None:
        return jax_launch(kernels().expert_gemm_kernel, inputs, out, grid, **warps, **consts)
    parts = jax.ShapeDtypeStruct((tile.k_split, r, n), jnp.float32)
    parts = jax_launch(kernels().expert_gemm_kernel, inputs, parts, grid, **warps, **consts)
    # No bias: w stands in for the pointer (HAS_BIAS=False, never read).
    return jax_launch(kernels().gemm_reduce_kernel, (parts, w, r), out, reduce[0], num_warps=4,
                      num_stages=1, **reduce[1])


def grouped_gemm_triton_torch(x, w, tile_expert, *, block_rows, out_dtype,
                              tile: GemmTile | None = None, schedule: str | None = None):
    """The trainer's twin: the same kernel launched by Triton on torch CUDA tensors."""
    import torch

    r, n, tile, (grid, consts), reduce = _plan(x, w, tile_expert, block_rows, out_dtype, tile,
                                               schedule)
    require_cuda_tensors("grouped_gemm_triton_torch", x, w, tile_expert)
    x, w = contiguous(x), contiguous(w)
    tile_expert = contiguous(tile_expert.to(torch.int32))
    out = torch.empty((r, n), dtype=torch_dtype(out_dtype), device=x.device)
    if r == 0:
        return out
    warps = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    if reduce is None:
        torch_launch(kernels().expert_gemm_kernel, (x, w, tile_expert, r), (out,), grid, **warps,
                     **consts)
        return out
    parts = torch.empty((tile.k_split, r, n), dtype=torch.float32, device=x.device)
    torch_launch(kernels().expert_gemm_kernel, (x, w, tile_expert, r), (parts,), grid, **warps,
                 **consts)
    torch_launch(kernels().gemm_reduce_kernel, (parts, w, r), (out,), reduce[0], num_warps=4,
                 num_stages=1, **reduce[1])
    return out


if triton_available():
    # The gemm leaf's impl name and declarations, so one request plans corresponding leaves.
    register("moe", "grouped_gemm", "triton_fixed_tile", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED, **INVARIANT)(grouped_gemm_triton)
