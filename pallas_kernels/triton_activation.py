"""("activation", "silu") on the GPU: x / (1 + exp(-x)) in f32, rounded once, as a Triton kernel.

The form of pallas_kernels/activation.py and of torch's ActivationSiluKernel, with the functions
torch CUDA uses: libdevice __nv_expf and IEEE division (div_rn). XLA's division on the GPU is not
IEEE-rounded (platform-facts.md: 1/x differs from torch in 13 % of f32 inputs), so the jnp form run
by XLA does not give these bits; this kernel, launched from JAX or from torch, does (measured on the
H200: 0 of 7,340,032 outputs differ from torch's F.silu, bf16 and f32; docs/gpu-validation.md).
Elementwise, so trivially batch-invariant.
"""

from __future__ import annotations

import jax

from pallas_kernels._triton_launch import (INVARIANT, cdiv, contiguous, dtype_name, jax_launch,
                                           kernels, require_cuda_tensors, torch_launch,
                                           triton_available)
from pallas_kernels.registry import Priority, register

FORMATS = {"bf16", "f32"}
BLOCK = 1024


def _check(x):
    if dtype_name(x.dtype) not in FORMATS:
        raise ValueError(f"silu: x.dtype={dtype_name(x.dtype)} must be one of {sorted(FORMATS)}")


def silu_triton(x):
    _check(x)
    n = x.size
    if n == 0:
        return x
    flat = x.reshape(-1)
    out = jax.ShapeDtypeStruct(flat.shape, x.dtype)
    y = jax_launch(kernels().silu_kernel, (flat, n), out, (cdiv(n, BLOCK),), num_warps=4,
                   num_stages=1, BLOCK=BLOCK)
    return y.reshape(x.shape)


def silu_triton_torch(x):
    import torch

    _check(x)
    require_cuda_tensors("silu_triton_torch", x)
    x = contiguous(x)
    out = torch.empty_like(x)
    if x.numel():
        torch_launch(kernels().silu_kernel, (x, x.numel()), (out,), (cdiv(x.numel(), BLOCK),),
                     num_warps=4, num_stages=1, BLOCK=BLOCK)
    return out


if triton_available():
    register("activation", "silu", "triton_elementwise", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED, **INVARIANT)(silu_triton)
