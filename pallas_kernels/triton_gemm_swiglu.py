"""("linear", "gemm_swiglu") on the GPU: SwiGLU's gate and up projections and its activation in
one Triton launch. **Experimental** (pallas_kernels/gemm_epilogues.py): a model plans the leaf
only when JENGINE_GEMM_EPILOGUES names `swiglu`; scripts/gpu_gemm_swiglu.py measures the launch's
bits and time on the GPU, `goldens_check_epilogues` the model's bits with it.

Why: an rl-bitwise decode step runs the gate/up grouped GEMM and then silu(gate) * up as a launch
of its own (32 per step of an 8B model, each with a gap before it: ~2 µs of kernel and ~1.7 µs of
gap at bs 1 on the H200). Here the grouped launch's programs compute the gate and up tiles as
they do, and the second of each (gate, up) pair to finish applies the activation to both
(pallas_kernels/_triton_gemm_epilogue_kernels.gemm_swiglu_kernel). It does not pay: on the H100
rl-bitwise's model rows were slower with it (pipelined bs 1 7.11 -> 7.31 ms, bs 16 7.70 -> 7.89,
the 4096-token prefill 142.2 -> 145.7; bs 64 / 256 within noise; twenty-sixth session, swiglu_ab):
the pair's second program waits on the first's tile and reads it back, which costs more than the
launch it removes. The form before it -- one program computing both tiles -- lost 33-38 % on the
H200 (docs/performance.md, eighteenth session). Kept as the switch's leaf, off.

What it computes is, bit for bit, the two launches it replaces (the interpreter checks the logic,
tests/test_triton_gemm_swiglu_interpreter.py; the GPU the bits):

    gate, up = gemm_group_triton(x, (w_gate, w_up), out_dtype=dtype)    # serial schedule
    act = silu_triton(gate, times=up)

Each projection keeps its own launch's K chunks (the table's tile for its (N, K, dtype)); the
launch shape is the grouped launch's at that M. No bias (SwiGLU's projections have none in every
supported family).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._triton_launch import (INVARIANT, Counters, cdiv, contiguous, dtype_name,
                                           jax_launch, require_cuda_tensors, torch_dtype,
                                           torch_launch, triton_available)
from pallas_kernels.gemm import FORMATS
from pallas_kernels.gemm_epilogues import composes
from pallas_kernels.registry import Priority, register
from pallas_kernels.triton_gemm import _check, _check_tile, _launches
from pallas_kernels.triton_gemm_tiles import GemmTile, tile_for


def kernels():
    """The experiments' @triton.jit sources, imported on first use (they import triton)."""
    from pallas_kernels import _triton_gemm_epilogue_kernels

    return _triton_gemm_epilogue_kernels


def _plan(x, w_gate, w_up, out_dtype, tile):
    """(m, n, tile, grid, constexprs) of one launch; refuses what the kernel cannot compute."""
    m, k, n = _check(x, w_gate, None, out_dtype)
    if tuple(w_up.shape) != tuple(w_gate.shape) or w_up.dtype != w_gate.dtype:
        raise ValueError(f"gemm_swiglu: w_up shape/dtype {tuple(w_up.shape)}/{w_up.dtype} must "
                         f"equal w_gate's {tuple(w_gate.shape)}/{w_gate.dtype}")
    if dtype_name(out_dtype) != dtype_name(x.dtype):
        raise ValueError(f"gemm_swiglu: out_dtype={dtype_name(out_dtype)} must be x's dtype "
                         f"({dtype_name(x.dtype)}): the activation reads the projections rounded "
                         "to the model dtype")
    tile = tile or tile_for(n, k, x.dtype, m)
    _check_tile(k, tile)
    # The dense launch's serial-schedule constexprs, less what this kernel fixes (no bias, never
    # split); twice its grid: a gate and an up tile per output tile.
    (grid, consts), _ = _launches(m, k, n, x.dtype, None, tile, "serial")
    consts = {key: v for key, v in consts.items() if key not in ("HAS_BIAS", "PARTIAL")}
    return m, n, tile, (2 * grid[0],), consts


def _pairs(m: int, n: int, tile: GemmTile) -> Counters:
    """One arrival counter per output tile (its gate and up programs count on it)."""
    return Counters(cdiv(m, tile.block_m) * cdiv(n, tile.block_n))


def gemm_swiglu_triton(x, w_gate, w_up, *, out_dtype, tile: GemmTile | None = None):
    """JAX: silu(x @ w_gate) * (x @ w_up) with HF's roundings, one launch."""
    m, n, tile, grid, consts = _plan(x, w_gate, w_up, out_dtype, tile)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    out = jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype))
    *_, act = jax_launch(kernels().gemm_swiglu_kernel,
                         (x, w_gate, w_up, m, _pairs(m, n, tile)), (out, out, out), grid,
                         num_warps=tile.num_warps, num_stages=tile.num_stages, **consts)
    return act


def gemm_swiglu_triton_torch(x, w_gate, w_up, *, out_dtype, tile: GemmTile | None = None):
    """The same launch on torch CUDA tensors."""
    import torch

    m, n, tile, grid, consts = _plan(x, w_gate, w_up, out_dtype, tile)
    require_cuda_tensors("gemm_swiglu_triton_torch", x, w_gate, w_up)
    x, w_gate, w_up = contiguous(x), contiguous(w_gate), contiguous(w_up)
    gate, up, out = (torch.empty((m, n), dtype=torch_dtype(out_dtype), device=x.device)
                     for _ in range(3))
    if m:
        torch_launch(kernels().gemm_swiglu_kernel, (x, w_gate, w_up, m, _pairs(m, n, tile)),
                     (gate, up, out), grid, num_warps=tile.num_warps,
                     num_stages=tile.num_stages, **consts)
    return out


if triton_available():
    register("linear", "gemm_swiglu", "triton_fixed_tile", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED, traits=INVARIANT["traits"],
             features={*INVARIANT["features"],
                       composes(gemm_group="triton_fixed_tile", silu="triton_elementwise")}
             )(gemm_swiglu_triton)
