"""("attention", "rope_write") on the GPU: both rotations and both page writes in one Triton launch.

XLA runs the portable form (pallas_kernels/rope_write.py) as four kernels per layer -- q's rotation,
k's, and the two page scatters -- each a launch and a gap on the device and a thunk on the host
(~14 us of host time each in rl-bitwise's decode step). This kernel does one token per program:
loads its cos / sin row, rotates q and k with the same three rounded operations per element, stores
q, and stores k and v at the token's (page, slot) of the pool, which jax-triton aliases in place
(the pool is donated to the step). Compiled with fp fusion off, its bits are the portable form's
under rl-bitwise's XLA flags (no excess precision): tests/test_triton_rope_write.py checks the logic
under Triton's interpreter, the H200 goldens the bits.

head_dim must be a power of two (tl.arange); a model with another head_dim plans the portable leaf.

`--numerics auto` plans `triton_fused_qkv`: the same kernel reading q, k and v from one [T,
(Hq + 2 Hkv) * D] array, their concatenation. Auto's q/k/v GEMMs are XLA's, whose dot merger makes
them one dot and then slices its output into three buffers for this launch (three copy kernels a
layer, 0.141 ms of auto's 5.13 ms bs-1 decode step on the H200, twenty-fourth session's profile);
concatenating those slices back is the dot's output itself, which XLA's simplifier should see, so
the launch would read the GEMM's output with no copy. Same arithmetic on the same values, so the
same bits as triton_fused (tests/test_triton_rope_write.py); rl-bitwise never plans it (its
grouped GEMM writes three buffers, which the concatenation would copy). H200 (twenty-eighth
session, gpu_run.sh auto_leaves_ab): auto's decode step 0.04-0.10 ms faster with it at bs 1 / 64 /
256 (5.50 -> 5.43, 8.25 -> 8.15, 17.42 -> 17.38 ms pipelined).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._triton_launch import (INVARIANT, contiguous, dtype_name, jax_launch,
                                           require_cuda_tensors, torch_launch, triton_available)
from pallas_kernels.fixed_order import next_pow2
from pallas_kernels.registry import Priority, register

FORMATS = {"bf16", "f32"}
NUM_WARPS = 4


def kernels():
    from pallas_kernels import _triton_rope_write_kernels

    return _triton_rope_write_kernels


def head_dim_supported(d) -> bool:
    return d >= 16 and d & (d - 1) == 0


def _check(q, k, v, cos, sin, kv):
    k_pages, v_pages = kv
    if dtype_name(q.dtype) not in FORMATS:
        raise ValueError(f"rope_write: q.dtype={dtype_name(q.dtype)} must be one of "
                         f"{sorted(FORMATS)}")
    t, _, d = q.shape
    if not head_dim_supported(d):
        raise ValueError(f"rope_write (Triton): head_dim={d} must be a power of two >= 16")
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"rope_write: k/v shapes {tuple(k.shape)}/{tuple(v.shape)} must be "
                         f"[{t}, Hkv, {d}]")
    if cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"rope_write: cos/sin shapes {tuple(cos.shape)}/{tuple(sin.shape)} must "
                         f"be ({t}, {d})")
    if k_pages.shape != v_pages.shape or k_pages.shape[2:] != k.shape[1:]:
        raise ValueError(f"rope_write: pages {tuple(k_pages.shape)}/{tuple(v_pages.shape)} must "
                         f"be [pages, page_size, {k.shape[1]}, {d}]")


def _constexprs(q, k, merged: bool) -> dict:
    hq, hkv = q.shape[1], k.shape[1]
    return dict(HQ=hq, HKV=hkv, HQP=next_pow2(hq), HKVP=next_pow2(hkv), D=q.shape[2], QKV=merged)


def rope_write_triton(q, k, v, cos, sin, kv, page, slot, *, merged=False):
    """merged: read q, k and v from their concatenation (triton_fused_qkv, module docstring)."""
    _check(q, k, v, cos, sin, kv)
    k_pages, v_pages = kv
    t = q.shape[0]
    if t == 0:
        return q, kv
    consts = _constexprs(q, k, merged)
    if merged:  # the kernel reads only the first; the others stand in for k_ptr / v_ptr
        q = k = v = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
    inputs = (q, k, v, cos, sin, page.astype(jnp.int32), slot.astype(jnp.int32), k_pages, v_pages,
              k_pages.shape[0], k_pages.shape[1])
    outs = (jax.ShapeDtypeStruct((t, consts["HQ"], consts["D"]), q.dtype),
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    q, k_pages, v_pages = jax_launch(kernels().rope_write_kernel, inputs, outs, (t,),
                                     num_warps=NUM_WARPS, num_stages=1, enable_fp_fusion=False,
                                     input_output_aliases={7: 1, 8: 2}, **consts)
    return q, (k_pages, v_pages)


def rope_write_triton_qkv(q, k, v, cos, sin, kv, page, slot):
    """triton_fused_qkv (--numerics auto): rope_write_triton on q/k/v's concatenation."""
    return rope_write_triton(q, k, v, cos, sin, kv, page, slot, merged=True)


def rope_write_triton_torch(q, k, v, cos, sin, kv, page, slot, *, merged=False):
    """The same kernel on torch tensors: returns the rotated q; kv's pages are written in place.
    merged: as rope_write_triton's."""
    import torch

    _check(q, k, v, cos, sin, kv)
    k_pages, v_pages = kv
    require_cuda_tensors("rope_write_triton_torch", q, k, v, cos, sin, k_pages, v_pages)
    q, k, v, cos, sin = (contiguous(a) for a in (q, k, v, cos, sin))
    out = torch.empty_like(q)
    t = q.shape[0]
    if t:
        consts = _constexprs(q, k, merged)
        if merged:
            q = k = v = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
        torch_launch(kernels().rope_write_kernel,
                     (q, k, v, cos, sin, page.to(torch.int32), slot.to(torch.int32), k_pages,
                      v_pages, k_pages.shape[0], k_pages.shape[1]),
                     (out, k_pages, v_pages), (t,), num_warps=NUM_WARPS, num_stages=1,
                     enable_fp_fusion=False, **consts)
    return out, (k_pages, v_pages)


if triton_available():
    register("attention", "rope_write", "triton_fused", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED, constraints={"head_dim": head_dim_supported},
             **INVARIANT)(rope_write_triton)
    # auto's (module docstring): deterministic, the same bits, but without the batch_invariant
    # feature, so rl-bitwise keeps the launch on three buffers
    register("attention", "rope_write", "triton_fused_qkv", formats=FORMATS, hardware={"gpu"},
             priority=Priority.TUNED + 1, constraints={"head_dim": head_dim_supported},
             traits={"deterministic": True})(rope_write_triton_qkv)
