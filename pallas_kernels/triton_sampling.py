"""("sampling", "block_sumexp") on the GPU: per-block sums of exp in the portable leaf's tree.

Contract (pallas_kernels/logprobs.py): ``fn(shifted f32[R, V], *, block_size) -> f32[R, V // block]``,
each block reduced in its own fixed tree. The tree here is the portable leaf's halving tree
(logprobs.tree_sum_last): for a power-of-two block the first levels add chunk c onto chunk c + n/2,
which the kernel writes out over up to 8 chunks of <= 4096 elements, then halves inside one chunk.
exp is libdevice __nv_expf, the function XLA's jnp.exp calls on the GPU, so the Triton kernel and
the portable leaf run by XLA on the GPU compute the same expression; docs/gpu-validation.md records
whether their bits agree.

Block widths that are not a power of two up to 32768 (the `torch` logprob order passes the whole
vocabulary as one block) take the portable leaf itself: the same tree by definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._triton_launch import (INVARIANT, contiguous, jax_launch, kernels,
                                           require_cuda_tensors, torch_launch, triton_available)
from pallas_kernels.logprobs import _check_block, block_sumexp_fixed_tree, torch_block_sumexp
from pallas_kernels.registry import Priority, register

MAX_CHUNK = 4096
MAX_TRITON_BLOCK = 8 * MAX_CHUNK


def _triton_params(block_size: int) -> dict | None:
    """Constexprs for the Triton path, or None when the width takes the portable tree."""
    if block_size & (block_size - 1) or block_size > MAX_TRITON_BLOCK:
        return None
    chunk = min(block_size, MAX_CHUNK)
    return dict(BLOCK=block_size, CHUNK=chunk, LOG2_CHUNK=chunk.bit_length() - 1)


def block_sumexp_triton(shifted, *, block_size: int):
    rows, blocks = _check_block(shifted, block_size)
    params = _triton_params(block_size)
    if params is None or shifted.dtype != jnp.float32 or rows == 0:
        return block_sumexp_fixed_tree(shifted, block_size=block_size)
    out = jax.ShapeDtypeStruct((rows, blocks), jnp.float32)
    return jax_launch(kernels().block_sumexp_kernel, (shifted,), out, (rows, blocks),
                      num_warps=8, num_stages=1, V=shifted.shape[1], **params)


def block_sumexp_triton_torch(shifted, *, block_size: int):
    import torch

    rows, blocks = _check_block(shifted, block_size)
    params = _triton_params(block_size)
    if params is None or shifted.dtype != torch.float32 or rows == 0:
        return torch_block_sumexp(shifted, block_size=block_size)
    require_cuda_tensors("block_sumexp_triton_torch", shifted)
    shifted = contiguous(shifted)
    out = torch.empty((rows, blocks), dtype=torch.float32, device=shifted.device)
    torch_launch(kernels().block_sumexp_kernel, (shifted,), (out,), (rows, blocks), num_warps=8,
                 num_stages=1, V=shifted.shape[1], **params)
    return out


if triton_available():
    register("sampling", "block_sumexp", "triton_fixed_tree", formats={"f32"}, hardware={"gpu"},
             priority=Priority.TUNED, **INVARIANT)(block_sumexp_triton)
