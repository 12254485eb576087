"""("activation", "silu") on the GPU: x / (1 + exp(-x)) in f32, rounded once, as a Triton kernel.

The form of pallas_kernels/activation.py and of torch's ActivationSiluKernel, with the functions
torch CUDA uses: libdevice __nv_expf and IEEE division (div_rn). XLA's division on the GPU is not
IEEE-rounded (platform-facts.md: 1/x differs from torch in 13 % of f32 inputs), so the jnp form run
by XLA does not give these bits; this kernel, launched from JAX or from torch, does (measured on the
H200: 0 of 7,340,032 outputs differ from torch's F.silu, bf16 and f32; docs/gpu-validation.md).
Elementwise, so trivially batch-invariant. ``times`` (SwiGLU's up): the SiLU rounded, then the
product in f32 rounded again -- the bits of the separate multiply (an exact bf16 x bf16 product,
one rounding), in the same launch.
"""

from __future__ import annotations

import jax

from pallas_kernels._triton_launch import (INVARIANT, cdiv, contiguous, dtype_name, jax_launch,
                                           kernels, require_cuda_tensors, torch_launch,
                                           triton_available)
from pallas_kernels.activation import check_times
from pallas_kernels.registry import Priority, register

FORMATS = {"bf16", "f32"}
BLOCK = 1024


def _check(x, times):
    if dtype_name(x.dtype) not in FORMATS:
        raise ValueError(f"silu: x.dtype={dtype_name(x.dtype)} must be one of {sorted(FORMATS)}")
    check_times(x, times)


def silu_triton(x, *, times=None):
    _check(x, times)
    n = x.size
    if n == 0:
        return x
    flat = x.reshape(-1)
    # No times: x stands in for its pointer; HAS_TIMES=False means it is never read.
    up = flat if times is None else times.reshape(-1)
    out = jax.ShapeDtypeStruct(flat.shape, x.dtype)
    y = jax_launch(kernels().silu_kernel, (flat, up), out, (cdiv(n, BLOCK),), num_warps=4,
                   num_stages=1, N=n, BLOCK=BLOCK, HAS_TIMES=times is not None)
    return y.reshape(x.shape)


def silu_triton_torch(x, *, times=None):
    import torch

    _check(x, times)
    require_cuda_tensors("silu_triton_torch", x, times)
    x = contiguous(x)
    up = x if times is None else contiguous(times)
    out = torch.empty_like(x)
    if x.numel():
        torch_launch(kernels().silu_kernel, (x, up), (out,), (cdiv(x.numel(), BLOCK),),
                     num_warps=4, num_stages=1, N=x.numel(), BLOCK=BLOCK,
                     HAS_TIMES=times is not None)
    return out


if triton_available():
    register("activation", "silu", "triton_elementwise", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED, **INVARIANT)(silu_triton)
