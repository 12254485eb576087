"""("norm", "rmsnorm") and ("norm", "add_rmsnorm") on the GPU: one Triton source, two hosts.

Same arithmetic as the portable leaves in pallas_kernels/rmsnorm.py (the HF form): widen to f32,
sum of squares in the halving tree of fixed_order.tree_sum (pad to a power of two with zeros, add
the upper half onto the lower half until one element is left), divide by H (IEEE division), multiply
by rsqrt(var + eps) (libdevice __nv_rsqrtf, the function XLA and torch call), round to the input
dtype, multiply by the weight rounded to that dtype, round again. One row per program, the tree is a
function of H alone, so a row's bits never depend on how many rows share the call.

`add_rmsnorm` is the fused layer-boundary form: the f32 sum x + residual feeds the norm and its
rounding is the new residual; with round_sum the rounded sum feeds the norm (the `unfused`
boundary's bits -- a separate add, then the norm -- in one launch instead of two). At prefill M
that launch takes several rows per program (ROWS_PLAN; add_rmsnorm_rows_kernel): the same size-2
sums per row, so the same bits, at a fraction of the one-row launch's time.

eps is passed as an f32 scalar from both hosts: jax-triton types a Python float as fp64 (torch's
Triton launcher as fp32), and an fp64 eps promotes `var + eps` and the rsqrt to fp64 -- measured on
the H200 as torch-vs-jax differences in up to 706,657 of 2,097,152 f32 outputs before this was fixed.
"""

from __future__ import annotations

import jax
import numpy as np

from pallas_kernels._triton_launch import (INVARIANT, cdiv, contiguous, dtype_name, jax_launch,
                                           kernels, require_cuda_tensors, torch_launch,
                                           triton_available)
from pallas_kernels.fixed_order import next_pow2
from pallas_kernels.registry import Priority, register

FORMATS = {"bf16", "f32"}


def _launch_params(h: int) -> tuple[dict, int]:
    block = next_pow2(h)
    num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    return dict(H=h, BLOCK=block, LOG2=block.bit_length() - 1), num_warps


def _check(name, x, weight, residual=None) -> tuple[int, int]:
    if len(x.shape) != 2:
        raise ValueError(f"{name}: x must be [rows, hidden], got shape {tuple(x.shape)}")
    m, h = x.shape
    if tuple(weight.shape) != (h,):
        raise ValueError(f"{name}: weight.shape={tuple(weight.shape)} must be ({h},)")
    if dtype_name(x.dtype) not in FORMATS:
        raise ValueError(f"{name}: x.dtype={dtype_name(x.dtype)} must be one of {sorted(FORMATS)}")
    if residual is not None and (tuple(residual.shape) != (m, h) or residual.dtype != x.dtype):
        raise ValueError(f"{name}: residual shape/dtype {tuple(residual.shape)}/{residual.dtype} "
                         f"must equal x's {(m, h)}/{x.dtype}")
    return m, h


def rmsnorm_triton(x, weight, *, eps):
    m, h = _check("rmsnorm", x, weight)
    if m == 0:
        return x
    consts, warps = _launch_params(h)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax_launch(kernels().rmsnorm_kernel, (x, weight, np.float32(eps)), out, (m,),
                      num_warps=warps, num_stages=1, **consts)


# (min rows, rows per program, warps) of the unfused boundary's launch on several rows per
# program, first match from the top; below every rule one row per program (add_rmsnorm_kernel, on
# _launch_params' warps: 8 at hidden 4096). One row per program on one warp at every M: the halving
# tree is then in-thread adds and shuffles only (sm_90: no barrier, no shared memory; 8 warps: 8
# barriers, 38 shared-memory stores). H100, µs per launch at hidden 4096, device time of 32
# launches in a CUDA graph (scripts/gpu_norm_rows.py, twenty-sixth session), one-row kernel ->
# this: M 1 4.4 -> 2.1, 64 4.8 -> 2.5, 256 8.4 -> 3.6, 1024 26.4 -> 8.2 (the twenty-fourth
# session's two rows on 4 warps: 13.7), 4096 99.3 -> 48.3 (54.1; one row on 2 warps 46.8). 0
# outputs differ in every plan at every M.
ROWS_PLAN: tuple[tuple[int, int, int], ...] = ((1, 1, 1),)


# The most elements of a row one warp holds (128 a thread): one warp at hidden 4096 takes 255
# registers without spilling (sm_90 ptxas, either sum); at hidden 5120 and 8192 (blocks of 8192)
# it spills 40 B and 6.8 KB a thread, two warps there spill nothing.
WARP_ROW_ELEMENTS = 4096


def rows_warps(block: int, warps: int) -> int:
    """A rows launch's warps: the plan's, or more where one warp would hold more of a row than
    WARP_ROW_ELEMENTS. The rounded sum's bits do not depend on the warps (add_rmsnorm_rows_kernel;
    0 outputs differ between every plan measured)."""
    return max(warps, block // WARP_ROW_ELEMENTS)


def rows_plan(m: int, round_sum: bool, plan=None) -> tuple[int, int] | None:
    """(rows per program, warps) of add_rmsnorm_rows_kernel for m rows, or None for the one-row
    kernel. Only the rounded sum (round_sum) may take it: see add_rmsnorm_rows_kernel. The warps
    are the plan's before rows_warps."""
    if not round_sum:
        return None
    return next(((rows, warps) for min_m, rows, warps in (ROWS_PLAN if plan is None else plan)
                 if m >= min_m), None)


def add_rmsnorm_triton(x, residual, weight, *, eps, round_sum=False):
    m, h = _check("add_rmsnorm", x, weight, residual)
    if m == 0:
        return x, residual
    consts, warps = _launch_params(h)
    outs = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype))
    rows = rows_plan(m, round_sum)
    if rows is not None:
        return jax_launch(kernels().add_rmsnorm_rows_kernel,
                          (x, residual, weight, np.float32(eps), m), outs, (cdiv(m, rows[0]),),
                          num_warps=rows_warps(consts["BLOCK"], rows[1]), num_stages=1,
                          ROWS=rows[0], **consts)
    normed, new_residual = jax_launch(kernels().add_rmsnorm_kernel,
                                      (x, residual, weight, np.float32(eps)), outs, (m,),
                                      num_warps=warps, num_stages=1, ROUND_SUM=bool(round_sum),
                                      **consts)
    return normed, new_residual


# auto keeps XLA's add + norm at every M. A one-row, one-warp launch of add_rmsnorm_rows_kernel on
# the f32 sum (triton_rows_auto, twenty-seventh session) measured slower in auto's model on the
# H200 (twenty-eighth session, auto_leaves_ab, pipelined ms with / without it: bs 1 5.43 / 5.22,
# bs 64 8.15 / 8.03, bs 256 17.38 / 17.56; blocked on at bs 1 6.46 / 6.00), so it was removed.
# Not profiled; a likely cause is the host: 63 more custom calls per step, and auto's host
# dispatch at bs 1 (4.40 / 3.98 ms in the two runs with it, 3.14 without) is most of its step.


def rmsnorm_triton_torch(x, weight, *, eps):
    """The trainer's twin: the same kernel launched by Triton on torch CUDA tensors."""
    import torch

    m, h = _check("rmsnorm_triton_torch", x, weight)
    require_cuda_tensors("rmsnorm_triton_torch", x, weight)
    x, weight = contiguous(x), contiguous(weight)
    out = torch.empty_like(x)
    if m:
        consts, warps = _launch_params(h)
        torch_launch(kernels().rmsnorm_kernel, (x, weight, float(eps)), (out,), (m,),
                     num_warps=warps, num_stages=1, **consts)
    return out


def mean_fixed_order_torch(x):
    """The trainer's ``mean(-1, keepdim=True)`` of an f32 tensor: the norm kernel's variance (its
    halving tree and div_rn). XLA's division on the GPU is not the kernel's (the first H200 bisect
    of DeepSeek-V3 found q_lora_rank 1536's norm one row apart, scripts/gpu_bisect_mla.py), so the
    generic XLA mean twin (pallas_kernels/rmsnorm.py) cannot stand in for this leaf's."""
    import torch

    if x.dtype != torch.float32:  # not a norm's variance: the generic fixed-order twin
        from pallas_kernels.rmsnorm import mean_fixed_order_torch as generic

        return generic(x)
    require_cuda_tensors("mean_fixed_order_torch", x)
    h = x.shape[-1]
    rows = contiguous(x).reshape(-1, h)
    out = torch.empty((rows.shape[0],), dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        consts, warps = _launch_params(h)
        torch_launch(kernels().mean_kernel, (rows,), (out,), (rows.shape[0],),
                     num_warps=warps, num_stages=1, **consts)
    return out.reshape(*x.shape[:-1], 1)


def add_rmsnorm_triton_torch(x, residual, weight, *, eps, round_sum=False, plan=None):
    """plan: rules in ROWS_PLAN's form in place of it (scripts/gpu_norm_rows.py times them)."""
    import torch

    m, h = _check("add_rmsnorm_triton_torch", x, weight, residual)
    require_cuda_tensors("add_rmsnorm_triton_torch", x, residual, weight)
    x, residual, weight = contiguous(x), contiguous(residual), contiguous(weight)
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    if m:
        consts, warps = _launch_params(h)
        rows = rows_plan(m, round_sum, plan)
        if rows is not None:
            torch_launch(kernels().add_rmsnorm_rows_kernel, (x, residual, weight, float(eps), m),
                         (out, new_residual), (cdiv(m, rows[0]),),
                         num_warps=rows_warps(consts["BLOCK"], rows[1]),
                         num_stages=1, ROWS=rows[0], **consts)
        else:
            torch_launch(kernels().add_rmsnorm_kernel, (x, residual, weight, float(eps)),
                         (out, new_residual), (m,), num_warps=warps, num_stages=1,
                         ROUND_SUM=bool(round_sum), **consts)
    return out, new_residual


if triton_available():
    register("norm", "rmsnorm", "triton_fixed_tree", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED, **INVARIANT)(rmsnorm_triton)
    register("norm", "add_rmsnorm", "triton_fixed_tree", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED, **INVARIANT)(add_rmsnorm_triton)
