"""("linear", "gemm") on the GPU: a fixed-tile Triton GEMM, batch-invariant and shared with torch.

Signature (pallas_kernels/gemm.py): ``fn(x[M, K], w[K, N], bias=None, *, out_dtype) -> [M, N]``;
f32 accumulation, optional bias added to the f32 accumulator, one rounding to ``out_dtype``.

Why a row's bits never depend on M: the tile (BM, BN, BK, KSPLIT), warps and stages are a function
of the static (N, K, dtype) alone (`tile_for`); K is cut into KSPLIT fixed chunks, each walked in
order BK at a time from a zero accumulator, and the chunk sums are added in chunk order; a row is
one row of each MMA, so changing M only changes how many tiles are launched.

Two schedules compute exactly that: `serial` (one program per output tile does every chunk) and
`split` (one program per tile and chunk, then gemm_reduce_kernel). Small M has too few output tiles
to fill the GPU, so it takes `split`; the choice depends on M, the bits do not (the row-invariance
check in scripts/gpu_validate.py compares M = 1, 2, 3, 7 and 64 -- split -- with M = 512 -- serial).
Measured on the H200 (docs/gpu-validation.md): rows bit-identical across M, and the jax-triton and
torch launches agree bit for bit.

`gemm_triton` is the JAX leaf; `gemm_triton_torch` launches the very same kernel on torch CUDA
tensors, for the trainer. Registration happens only where triton and jax-triton are importable.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels._triton_launch import (INVARIANT, cdiv, contiguous, dtype_name, jax_launch,
                                           kernels, require_cuda_tensors, torch_dtype,
                                           torch_launch, triton_available)
from pallas_kernels.registry import Priority, register

FORMATS = {"bf16", "f32"}


@dataclass(frozen=True)
class GemmTile:
    """One fixed tiling. Never chosen from M (that would make a row's bits depend on the batch)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    k_split: int = 1  # fixed K chunks; K must be a multiple of k_split * block_k when > 1

    def describe(self) -> str:
        split = f" k{self.k_split}" if self.k_split > 1 else ""
        return (f"BM{self.block_m}xBN{self.block_n}xBK{self.block_k} g{self.group_m} "
                f"w{self.num_warps} s{self.num_stages}{split}")


# bf16 default: one warpgroup (wgmma m64), 64-deep K steps.
DEFAULT_BF16_TILE = GemmTile(64, 128, 64, group_m=8, num_warps=4, num_stages=4)
# f32 runs the IEEE FMA path (no TF32): small tiles, it exists for correctness, not speed.
DEFAULT_F32_TILE = GemmTile(32, 32, 32, group_m=8, num_warps=4, num_stages=2)

# Per-shape tiles for bf16, keyed by (N, K): the Llama-3-8B projections, chosen from the H200 tile
# sweep (scripts/triton_tile_sweep.py; docs/performance.md has the timings). Each is one tile for
# every M, so each trades decode (M <= 256, weight-streaming bound) against prefill (M = 4096).
# k_split gives small-M steps (decode) enough programs: at M <= 64 q_proj has 32 output tiles for
# 132 SMs; split 4 ways it has 128.
TUNED_BF16_TILES: dict[tuple[int, int], GemmTile] = {
    (4096, 4096): GemmTile(64, 128, 128, num_warps=4, num_stages=3, k_split=4),  # q_proj, o_proj
    (1024, 4096): GemmTile(64, 64, 128, num_warps=4, num_stages=6, k_split=8),  # k_proj, v_proj
    (14336, 4096): GemmTile(128, 128, 64, num_warps=8, num_stages=4, k_split=2),  # gate, up
    (4096, 14336): GemmTile(64, 64, 128, num_warps=4, num_stages=6, k_split=4),  # down_proj
}
# Below this many output tiles a step runs the split schedule (when the tile has k_split > 1).
SPLIT_BELOW_TILES = 128
REDUCE_BLOCK = 1024
# Wide outputs (LM heads): 128x256 tiles matched cuBLAS from M = 1 to 4096 at N = 131072.
WIDE_BF16_TILE = GemmTile(128, 256, 64, num_warps=8, num_stages=3)
WIDE_N = 32768


def tile_for(n: int, k: int, dtype) -> GemmTile:
    """The tile for a static (N, K, dtype). The row count is deliberately not an argument."""
    if dtype_name(dtype) == "f32":
        return DEFAULT_F32_TILE
    if (n, k) in TUNED_BF16_TILES:
        return TUNED_BF16_TILES[(n, k)]
    return WIDE_BF16_TILE if n >= WIDE_N else DEFAULT_BF16_TILE


def _check(x, w, bias, out_dtype) -> tuple[int, int, int]:
    if len(x.shape) != 2 or len(w.shape) != 2:
        raise ValueError(f"gemm: x and w must be 2-D, got x.shape={tuple(x.shape)}, "
                         f"w.shape={tuple(w.shape)}")
    m, k = x.shape
    if w.shape[0] != k:
        raise ValueError(f"gemm: x.shape[1]={k} does not match w.shape[0]={w.shape[0]}")
    n = w.shape[1]
    xd, wd = dtype_name(x.dtype), dtype_name(w.dtype)
    if xd not in FORMATS or xd != wd:
        raise ValueError(f"gemm: x.dtype={xd} and w.dtype={wd} must be equal and one of "
                         f"{sorted(FORMATS)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"gemm: bias.shape={tuple(bias.shape)} must be ({n},)")
    if dtype_name(out_dtype) not in ("bf16", "f32", "f16"):
        raise ValueError(f"gemm: out_dtype={out_dtype} must be bf16, f16 or f32")
    return m, k, n


def _check_tile(k: int, tile: GemmTile) -> None:
    if tile.k_split > 1 and k % (tile.k_split * tile.block_k):
        raise ValueError(f"gemm: K={k} is not a multiple of k_split * block_k = "
                         f"{tile.k_split} * {tile.block_k} ({tile.describe()})")


def schedule_for(m: int, n: int, tile: GemmTile, schedule: str | None = None) -> str:
    if schedule:
        return schedule
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    return "split" if tile.k_split > 1 and tiles < SPLIT_BELOW_TILES else "serial"


def _launches(m, k, n, dtype, bias, tile: GemmTile, schedule: str):
    """(grid, constexprs) of the GEMM kernel and, for the split schedule, of the reduce kernel."""
    consts = dict(N=n, K=k, HAS_BIAS=bias is not None, IEEE_F32=dtype_name(dtype) == "f32",
                  BM=tile.block_m, BN=tile.block_n, BK=tile.block_k, GROUP_M=tile.group_m,
                  KSPLIT=tile.k_split, PARTIAL=schedule == "split")
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    if schedule == "serial":
        return ((tiles,), consts), None
    reduce = dict(N=n, HAS_BIAS=bias is not None, KSPLIT=tile.k_split, BLOCK=REDUCE_BLOCK)
    return ((tiles, tile.k_split), consts), ((cdiv(m * n, REDUCE_BLOCK),), reduce)


def gemm_triton(x, w, bias=None, *, out_dtype, tile: GemmTile | None = None,
                schedule: str | None = None):
    """JAX leaf: the fixed-tile kernel through jax-triton (works inside and outside jit)."""
    m, k, n = _check(x, w, bias, out_dtype)
    tile = tile or tile_for(n, k, x.dtype)
    _check_tile(k, tile)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    schedule = schedule_for(m, n, tile, schedule)
    (grid, consts), reduce = _launches(m, k, n, x.dtype, bias, tile, schedule)
    out = jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype))
    # No bias: any array stands in for the pointer; HAS_BIAS=False means it is never read.
    b = w if bias is None else bias
    warps = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    if reduce is None:
        return jax_launch(kernels().fixed_tile_gemm_kernel, (x, w, b, m), out, grid, **warps,
                          **consts)
    parts = jax.ShapeDtypeStruct((tile.k_split, m, n), jnp.float32)
    parts = jax_launch(kernels().fixed_tile_gemm_kernel, (x, w, b, m), parts, grid, **warps,
                       **consts)
    return jax_launch(kernels().gemm_reduce_kernel, (parts, b, m), out, reduce[0], num_warps=4,
                      num_stages=1, **reduce[1])


def gemm_triton_torch(x, w, bias=None, *, out_dtype, tile: GemmTile | None = None,
                      schedule: str | None = None):
    """The trainer's twin: the same kernel launched by Triton on torch CUDA tensors."""
    import torch

    m, k, n = _check(x, w, bias, out_dtype)
    require_cuda_tensors("gemm_triton_torch", x, w, bias)
    x, w, bias = contiguous(x), contiguous(w), contiguous(bias)
    tile = tile or tile_for(n, k, x.dtype)
    _check_tile(k, tile)
    out = torch.empty((m, n), dtype=torch_dtype(out_dtype), device=x.device)
    if m == 0:
        return out
    schedule = schedule_for(m, n, tile, schedule)
    (grid, consts), reduce = _launches(m, k, n, x.dtype, bias, tile, schedule)
    b = w if bias is None else bias
    warps = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    if reduce is None:
        torch_launch(kernels().fixed_tile_gemm_kernel, (x, w, b, m), (out,), grid, **warps,
                     **consts)
        return out
    parts = torch.empty((tile.k_split, m, n), dtype=torch.float32, device=x.device)
    torch_launch(kernels().fixed_tile_gemm_kernel, (x, w, b, m), (parts,), grid, **warps, **consts)
    torch_launch(kernels().gemm_reduce_kernel, (parts, b, m), (out,), reduce[0], num_warps=4,
                 num_stages=1, **reduce[1])
    return out


if triton_available():
    register("linear", "gemm", "triton_fixed_tile", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED, **INVARIANT)(gemm_triton)
