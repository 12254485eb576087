"""Reductions whose order is fixed by static shapes alone.

XLA's own dot and reduce emitters pick tiling and split-K by shape, so a row's bits change with the
number of rows (platform-facts.md). The forms here are built only from elementwise operations whose
structure depends on the reduced length, never on the other dimensions: each output element is the
same sequence of IEEE operations on the same operands whatever the batch, so row invariance holds by
construction on any backend.

FMA note: XLA (CPU and GPU) contracts ``a * b + c`` into a fused multiply-add whenever the multiply
and the add land in one fusion, and *whether* they do is XLA's choice, which changes with shapes (a
loop of one trip is inlined, a product with two consumers is recomputed in one program and stored in
another). No flag turns it off and ``optimization_barrier`` does not survive XLA:CPU's pipeline. So a
fixed-order form obeys one rule: **an inexact product never meets an add**. A product either is
exact (bf16 x bf16 widened to f32: 8 + 8 significant bits fit in 24) and may be fused or not with the
same result, or it is split into exact partial products (``split_product``), or it only feeds a
non-additive op (``exp((s - m) * scale)``, a conversion). Measured (jaxlib 0.10.2 CPU, 4M inputs):
``exp(a * b - m)`` differs from ``exp(RN(a * b) - m)`` in 998,546 elements; ``exp((a - m) * b)`` and
``exp(a * b)`` do not differ from their rounded forms.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
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


def _truncate(x: jax.Array, low_bits: int) -> jax.Array:
    """f32 x with its ``low_bits`` lowest mantissa bits cleared (toward zero; an integer op, exact)."""
    mask = jnp.uint32((0xFFFFFFFF << low_bits) & 0xFFFFFFFF)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & mask, jnp.float32)


def split_product(a: jax.Array, b: jax.Array, b_dtype) -> jax.Array:
    """``a * b`` (f32) as a sum of exact partial products, so no FMA contraction can change it.

    ``b`` holds ``b_dtype`` values widened to f32. For bf16 ``b`` (8 significant bits), ``a`` is split
    into its top 8 bits and the exact remainder (<= 16 bits): both partial products are exact and
    their one rounded sum is the correctly rounded product RN(a * b), fused or not. For f32 ``b``
    both factors are split into 12-bit halves and the four exact partial products are summed
    pairwise in a fixed order: a fixed function of (a, b), within a few ulp of RN(a * b).
    (Subnormal partial products round, and may then round differently under contraction.)
    """
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    if jnp.dtype(b_dtype) == jnp.dtype(jnp.bfloat16):
        a_hi = _truncate(a, 16)
        return a_hi * b + (a - a_hi) * b
    a_hi, b_hi = _truncate(a, 12), _truncate(b, 12)
    a_lo, b_lo = a - a_hi, b - b_hi
    return (a_hi * b_hi + a_hi * b_lo) + (a_lo * b_hi + a_lo * b_lo)


def _pieces(value: float, count: int, bits: int) -> tuple[np.float32, ...]:
    """``value`` as ``count`` f32 pieces of at most ``bits`` significant bits each (their exact
    sum is ``value`` to ~count * bits bits): a product of a piece with a small integer is exact."""
    out, rest = [], float(value)
    for _ in range(count):
        exponent = math.floor(math.log2(abs(rest))) if rest else 0
        piece = math.floor(rest / 2.0 ** (exponent - bits + 1)) * 2.0 ** (exponent - bits + 1)
        out.append(np.float32(piece))
        rest -= float(np.float32(piece))
    return tuple(out)


_LOG2E = np.float32(1.0 / math.log(2.0))
_LN2 = _pieces(math.log(2.0), 3, 15)  # n * piece is exact for |n| <= 2^9
_EXP_COEFFS = tuple(np.float32(1.0 / math.factorial(k)) for k in range(9))  # |r| <= ln2/2


def fixed_exp(x: jax.Array) -> jax.Array:
    """exp for f32, the same bits in every program: basic IEEE operations and exact products only.

    XLA:CPU's own exp is two functions: its vectorized loops and its scalar loops give different
    bits for ~9 % of inputs, and whether a fused exp is vectorized depends on what it is fused with
    (measured: a 320-row attention step fused the max into the exp's loop and lost vectorization,
    a 1-row step did not, and one row's output moved by a bf16 ulp). This form has nothing that
    changes with that: n = round(x / ln 2); r = x - n * ln 2 with ln 2 in three 15-bit pieces (each
    product exact); a degree-8 Taylor polynomial in Horner form whose every multiply is an exact
    `split_product` (so FMA contraction cannot change a step); times 2^n built from the exponent
    bits. Accuracy: within 1 ulp of exp on the normal range, ~90 % exact (tests/test_leaves.py). Outputs below
    2^-126 flush to +0.0; exp(-inf) = +0.0, exp(+inf) = inf, NaN stays NaN.
    """
    x = x.astype(jnp.float32)
    xc = jnp.clip(x, jnp.float32(-88.0), jnp.float32(88.0))
    n = jnp.round(xc * _LOG2E)  # the product only feeds a rounding to an integer
    r = xc
    for piece in _LN2:
        r = r - n * piece  # exact product: |n| <= 127, 15-bit piece
    p = jnp.full_like(r, _EXP_COEFFS[-1])
    for c in reversed(_EXP_COEFFS[:-1]):
        p = c + split_product(r, p, jnp.float32)
    scale = lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)  # 2^n
    y = p * scale
    y = jnp.where(x < jnp.float32(-87.33654), jnp.float32(0.0), y)  # below the normal range
    y = jnp.where(x > jnp.float32(88.72283), jnp.float32(jnp.inf), y)
    return jnp.where(jnp.isnan(x), x, y)


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
