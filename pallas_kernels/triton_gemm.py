"""("linear", "gemm") and ("linear", "gemm_group") on the GPU: a fixed-tile Triton GEMM,
batch-invariant and shared with torch.

Signature (pallas_kernels/gemm.py): ``fn(x[M, K], w[K, N], bias=None, *, out_dtype) -> [M, N]``;
f32 accumulation, optional bias added to the f32 accumulator, one rounding to ``out_dtype``.

Why a row's bits never depend on M: K is cut into KSPLIT fixed chunks -- KSPLIT a function of the
static (N, K, dtype) alone (`tile_for`: the tables of triton_gemm_tiles.json, read by
triton_gemm_tiles.py) -- each walked in order from a zero accumulator, the MMA stepping K 16 at a
time, and the chunk sums are added in chunk order; a row is one row of each MMA, so changing M only
changes how many tiles are launched. The launch shape (BM, BN, BK, warps, stages) may follow M
(a table's `by_m` rules give decode steps smaller tiles): on the H200 every launch shape on the
same K chunks gave 0 differing f32 outputs (scripts/gpu_gemm_decode_tiles.py).

Two schedules compute exactly that: `serial` (one program per output tile does every chunk -- in
one K loop for a tile with `flat_k`, one loop per chunk otherwise) and
`split` (one program per tile and chunk, then gemm_reduce_kernel -- or, for a tile with
`fused_reduce`, the tile's last program adds the chunks in the same order inside the one launch).
Small M has too few output tiles to fill the GPU, so it takes `split`; tiles with
`split_at_every_m` take it at every M (the per-chunk serial form is slow at k_split 4; the
Llama-3-8B entries' prefill tiles run the flat one instead, 2026-12-05). The choice depends
on M, the bits do not (the row-invariance check in scripts/gpu_validate.py compares M = 1, 2, 3, 7
and 64 -- split, on the decode launch shapes -- with M = 512 -- the entry's tile, serial).
Measured on the H200 (docs/gpu-validation.md): rows bit-identical across M, and the jax-triton and
torch launches agree bit for bit.

The ("linear", "gemm_group") leaf (`gemm_group_triton`): projections of one x that share a tile
(q/k/v, gate/up) run as one launch whose programs each run the same tile body on their member, so
every output has the bits of its own launch and the trainer's separate projections still match;
it saves a launch per member and fills the GPU better at small M.

`gemm_triton` is the JAX leaf; `gemm_triton_torch` launches the very same kernel on torch CUDA
tensors, for the trainer. Registration happens only where triton and jax-triton are importable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._triton_launch import (INVARIANT, Counters, cdiv, contiguous, dtype_name,
                                           jax_launch, require_cuda_tensors, torch_dtype,
                                           torch_launch, triton_available)
from pallas_kernels.gemm import FORMATS, XLA_NATIVE, gemm_group_xla_native, gemm_xla_native
from pallas_kernels.registry import Priority, register
from pallas_kernels.triton_gemm_tiles import TILES, GemmTile, tile_for

# Below this many output tiles a step runs the split schedule (when the tile has k_split > 1).
SPLIT_BELOW_TILES = 128
REDUCE_BLOCK = 1024


def kernels():
    """The GEMM's @triton.jit sources, imported on first use (they import triton)."""
    from pallas_kernels import _triton_gemm_kernels

    return _triton_gemm_kernels


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
    few = tiles < SPLIT_BELOW_TILES
    return "split" if tile.k_split > 1 and (few or tile.split_at_every_m) else "serial"


def _flat_k(tile: GemmTile, schedule: str) -> bool:
    """The serial schedule's chunks in one K loop (a tile's flat_k; chunks exist at k_split > 1)."""
    return tile.flat_k and tile.k_split > 1 and schedule == "serial"


def _launches(m, k, n, dtype, bias, tile: GemmTile, schedule: str):
    """(grid, constexprs) of the GEMM kernel and, for the split schedule, of the reduce kernel."""
    consts = dict(N=n, K=k, HAS_BIAS=bias is not None, IEEE_F32=dtype_name(dtype) == "f32",
                  BM=tile.block_m, BN=tile.block_n, BK=tile.block_k, GROUP_M=tile.group_m,
                  KSPLIT=tile.k_split, PARTIAL=schedule == "split",
                  FLAT_K=_flat_k(tile, schedule))
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    if schedule == "serial":
        return ((tiles,), consts), None
    reduce = dict(N=n, HAS_BIAS=bias is not None, KSPLIT=tile.k_split, BLOCK=REDUCE_BLOCK)
    return ((tiles, tile.k_split), consts), ((cdiv(m * n, REDUCE_BLOCK),), reduce)


def _fused(consts: dict) -> dict:
    """The split kernels' constexprs for their fused-reduce forms (which always split)."""
    return {k: v for k, v in consts.items() if k not in ("PARTIAL", "FLAT_K")}


def gemm_triton(x, w, bias=None, *, out_dtype, tile: GemmTile | None = None,
                schedule: str | None = None):
    """JAX leaf: the fixed-tile kernel through jax-triton (works inside and outside jit)."""
    m, k, n = _check(x, w, bias, out_dtype)
    tile = tile or tile_for(n, k, x.dtype, m)
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
    if tile.fused_reduce:
        return jax_launch(kernels().fixed_tile_gemm_fused_kernel, (x, w, b, m, Counters(grid[0])),
                          (parts, out), grid, **warps, **_fused(consts))[1]
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
    tile = tile or tile_for(n, k, x.dtype, m)
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
    if tile.fused_reduce:
        torch_launch(kernels().fixed_tile_gemm_fused_kernel, (x, w, b, m, Counters(grid[0])),
                     (parts, out), grid, **warps, **_fused(consts))
        return out
    torch_launch(kernels().fixed_tile_gemm_kernel, (x, w, b, m), (parts,), grid, **warps, **consts)
    torch_launch(kernels().gemm_reduce_kernel, (parts, b, m), (out,), reduce[0], num_warps=4,
                 num_stages=1, **reduce[1])
    return out


# -- grouped: several projections of one x in one launch ------------------------------------------


def group_tile(x, ws, biases) -> GemmTile | None:
    """The one tile every member uses at this M, or None when the members do not share a launch
    (different tiles, bias on some members only, not 2-3 members, or a tile marked ungrouped):
    they then run one launch each, on the same tiles, so with the same bits."""
    if len(ws) not in (2, 3) or (biases is not None and any(b is None for b in biases)):
        return None
    m, k = x.shape
    tiles = {tile_for(w.shape[1], k, x.dtype, m) for w in ws}
    tile = tiles.pop() if len(tiles) == 1 else None
    return tile if tile is not None and tile.grouped else None


def _group_launches(m, k, ns, dtype, has_bias, tile: GemmTile, schedule: str | None):
    """(grid, constexprs) of grouped_gemm_kernel and, for the split schedule, of the grouped reduce."""
    n0, n1, n2 = (*ns, 0)[:3]
    col_tiles = sum(cdiv(n, tile.block_n) for n in ns)
    schedule = schedule_for(m, col_tiles * tile.block_n, tile, schedule)
    consts = dict(N0=n0, N1=n1, N2=n2, K=k, HAS_BIAS=has_bias, IEEE_F32=dtype_name(dtype) == "f32",
                  BM=tile.block_m, BN=tile.block_n, BK=tile.block_k, GROUP_M=tile.group_m,
                  KSPLIT=tile.k_split, PARTIAL=schedule == "split",
                  FLAT_K=_flat_k(tile, schedule), EVEN_N=all(n % tile.block_n == 0 for n in ns))
    tiles = cdiv(m, tile.block_m) * col_tiles
    if schedule == "serial":
        return ((tiles,), consts), None
    reduce = dict(N0=n0, N1=n1, N2=n2, HAS_BIAS=has_bias, KSPLIT=tile.k_split, BLOCK=REDUCE_BLOCK)
    blocks = sum(cdiv(m * n, REDUCE_BLOCK) for n in ns)
    return ((tiles, tile.k_split), consts), ((blocks,), reduce)


def _pad3(items, filler):
    return (*items, filler) if len(items) == 2 else tuple(items)


def gemm_group_triton(x, ws, biases=None, *, out_dtype, schedule: str | None = None,
                      tile: GemmTile | None = None):
    """JAX: (x @ w_i (+ b_i) for each w_i) in one launch (+ one reduce, unless the tile fuses it),
    each output bit-identical to gemm_triton(x, w_i, b_i): the same tile body with the same tile
    (group_tile; `tile` forces one, for experiments). Members that cannot share a tile run one
    gemm_triton each."""
    for i, w in enumerate(ws):
        _check(x, w, None if biases is None else biases[i], out_dtype)
    tile = tile or group_tile(x, ws, biases)
    if tile is None:
        return tuple(gemm_triton(x, w, None if biases is None else biases[i], out_dtype=out_dtype,
                                 schedule=schedule) for i, w in enumerate(ws))
    m, k = x.shape
    ns = [w.shape[1] for w in ws]
    _check_tile(k, tile)
    if m == 0:
        return tuple(jnp.zeros((0, n), out_dtype) for n in ns)
    (grid, consts), reduce = _group_launches(m, k, ns, x.dtype, biases is not None, tile, schedule)
    w3 = _pad3(tuple(ws), ws[0])
    b3 = w3 if biases is None else _pad3(tuple(biases), biases[0])
    # out2 of a two-member group: never written, but of the members' type (the kernel selects
    # among the output pointers, which must share one).
    unused = jax.ShapeDtypeStruct((1,), jnp.dtype(out_dtype))
    unused_part = jax.ShapeDtypeStruct((1,), jnp.float32)
    warps = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    outs = _pad3([jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype)) for n in ns], unused)
    if reduce is None:
        res = jax_launch(kernels().grouped_gemm_kernel, (x, *w3, *b3, m), outs, grid, **warps,
                         **consts)
        return tuple(res[:len(ns)])
    parts = _pad3([jax.ShapeDtypeStruct((tile.k_split, m, n), jnp.float32) for n in ns],
                  unused_part)
    if tile.fused_reduce:
        res = jax_launch(kernels().grouped_gemm_fused_kernel,
                         (x, *w3, *b3, m, Counters(grid[0])), (*parts, *outs), grid, **warps,
                         **_fused(consts))
        return tuple(res[3:3 + len(ns)])
    parts = jax_launch(kernels().grouped_gemm_kernel, (x, *w3, *b3, m), parts, grid, **warps,
                       **consts)
    res = jax_launch(kernels().grouped_reduce_kernel, (*parts, *b3, m), outs, reduce[0],
                     num_warps=4, num_stages=1, **reduce[1])
    return tuple(res[:len(ns)])


def gemm_group_triton_torch(x, ws, biases=None, *, out_dtype, schedule: str | None = None,
                            tile: GemmTile | None = None):
    """The grouped launch on torch tensors (the trainer's separate gemm_triton_torch calls give the
    same bits; this exists so that claim can be checked from one host)."""
    import torch

    for i, w in enumerate(ws):
        _check(x, w, None if biases is None else biases[i], out_dtype)
    tile = tile or group_tile(x, ws, biases)
    if tile is None:
        return tuple(gemm_triton_torch(x, w, None if biases is None else biases[i],
                                       out_dtype=out_dtype, schedule=schedule)
                     for i, w in enumerate(ws))
    require_cuda_tensors("gemm_group_triton_torch", x, *ws, *(biases or ()))
    x = contiguous(x)
    ws = [contiguous(w) for w in ws]
    biases = None if biases is None else [contiguous(b) for b in biases]
    m, k = x.shape
    ns = [w.shape[1] for w in ws]
    _check_tile(k, tile)
    outs = [torch.empty((m, n), dtype=torch_dtype(out_dtype), device=x.device) for n in ns]
    if m == 0:
        return tuple(outs)
    (grid, consts), reduce = _group_launches(m, k, ns, x.dtype, biases is not None, tile, schedule)
    w3 = _pad3(tuple(ws), ws[0])
    b3 = w3 if biases is None else _pad3(tuple(biases), biases[0])
    unused = torch.empty(1, dtype=torch_dtype(out_dtype), device=x.device)
    unused_part = torch.empty(1, dtype=torch.float32, device=x.device)
    warps = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    if reduce is None:
        torch_launch(kernels().grouped_gemm_kernel, (x, *w3, *b3, m), _pad3(outs, unused), grid,
                     **warps, **consts)
        return tuple(outs)
    parts = [torch.empty((tile.k_split, m, n), dtype=torch.float32, device=x.device) for n in ns]
    if tile.fused_reduce:
        torch_launch(kernels().grouped_gemm_fused_kernel, (x, *w3, *b3, m, Counters(grid[0])),
                     (*_pad3(parts, unused_part), *_pad3(outs, unused)), grid, **warps,
                     **_fused(consts))
        return tuple(outs)
    torch_launch(kernels().grouped_gemm_kernel, (x, *w3, *b3, m), _pad3(parts, unused_part), grid,
                 **warps, **consts)
    torch_launch(kernels().grouped_reduce_kernel, (*_pad3(parts, unused_part), *b3, m),
                 _pad3(outs, unused), reduce[0], num_warps=4, num_stages=1, **reduce[1])
    return tuple(outs)


if triton_available():
    # The same impl name and declarations in both families, so one request plans both. No
    # width_invariant trait: the tile (its K schedule) follows the local N, so a column-parallel
    # shard may not compute the one-device bits (docs/parallelism.md, the GPU topology gap).
    for family_name, fn in (("gemm", gemm_triton), ("gemm_group", gemm_group_triton)):
        register("linear", family_name, "triton_fixed_tile", formats=FORMATS, hardware={"gpu"},
                 priority=Priority.TUNED, **INVARIANT)(fn)


# -- auto: XLA's dots, the MLP's gate/up at decode rows on the grouped launch ----------------------
# Measured on the H100 (docs/performance.md, thirtieth session; auto's pipelined decode ms, XLA's
# leaves / gate/up on the grouped launch at <= 256 rows / XLA's again): bs 1 6.79 / 6.70 / 6.72,
# bs 64 10.62 / 10.16 / 10.52, bs 256 20.89 / 21.65 / 20.94. XLA runs gate and up as two dots; the
# grouped launch reads both in one. q/k/v stays on XLA's merged dot (RoPE reads its one output,
# pallas_kernels/triton_rope_write.py), and with it on the grouped launch too bs 1 lost 0.04 ms.
AUTO_GATE_UP_MAX_M = 64


def gemm_group_auto(x, ws, biases=None, *, out_dtype):
    """A two-member group without biases (gate/up) of at most AUTO_GATE_UP_MAX_M rows whose
    members have a tuned tile: the grouped Triton launch; every other group: XLA's dot per member.
    For --numerics auto only (no batch_invariant feature): its members do not have the bits of
    this impl's gemm (XLA's dot), which no contract of auto's asks for."""
    m, k = x.shape
    tuned = TILES.tuned()
    if (len(ws) == 2 and biases is None and m <= AUTO_GATE_UP_MAX_M
            and all((w.shape[1], k, dtype_name(x.dtype)) in tuned for w in ws)):
        return gemm_group_triton(x, ws, None, out_dtype=out_dtype)
    return gemm_group_xla_native(x, ws, biases, out_dtype=out_dtype)


if triton_available():
    # Above xla_native, on GPUs only; the gemm of the pair is XLA's dot itself.
    AUTO = dict(XLA_NATIVE, hardware={"gpu"}, priority=XLA_NATIVE["priority"] + 1)
    register("linear", "gemm", "xla_gate_up_triton", **AUTO)(gemm_xla_native)
    register("linear", "gemm_group", "xla_gate_up_triton", **AUTO)(gemm_group_auto)
