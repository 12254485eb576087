"""Reductions whose order is fixed by static shapes alone.

XLA's own dot and reduce emitters pick tiling and split-K by shape, so a row's bits change with the
number of rows (platform-facts.md). The forms here are built only from elementwise operations whose
structure depends on the reduced length, never on the other dimensions: each output element is the
same sequence of IEEE operations on the same operands whatever the batch, so row invariance holds by
construction on any backend.

FMA note: XLA:CPU contracts ``acc + a * b`` into a fused multiply-add. When ``a`` and ``b`` are bf16
values widened to f32 the product is exact, so the fused and unfused forms round identically; for
f32 operands the contraction is still the same for every row and every batch shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): tree widths, Triton blocks, shape buckets."""
    return 1 << (max(n, minimum) - 1).bit_length()


def tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Pairwise halving-add tree over ``axis`` (zero-padded to a power of two)."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    width = next_pow2(n)
    if width != n:
        pad = [(0, 0)] * (x.ndim - 1) + [(0, width - n)]
        x = jnp.pad(x, pad)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def sequential_dot(x: jax.Array, w: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """f32 ``x[M,K] @ w[K,N]`` accumulated over k = 0..K-1 in order, one row at a time in effect.

    Each output element is ``(((0 + x0*w0) + x1*w1) + ...)`` in f32: the trainer-side twin can
    reproduce it with the same loop (bf16 operands make every product exact in f32).
    """
    x = x.astype(jnp.float32)
    w = w.astype(jnp.float32)
    m, k = x.shape
    n = w.shape[1]

    def body(i, acc):
        xi = lax.dynamic_slice_in_dim(x, i, 1, axis=1)  # [M, 1]
        wi = lax.dynamic_slice_in_dim(w, i, 1, axis=0)  # [1, N]
        return acc + xi * wi

    acc = lax.fori_loop(0, k, body, jnp.zeros((m, n), jnp.float32), unroll=min(k, 8))
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return acc
