"""("norm", "rmsnorm") and ("norm", "add_rmsnorm").

``rmsnorm(x, weight, *, eps)`` is the HF/trainer form: widen to f32, mean of squares, multiply by
``rsqrt(var + eps)``, round to the input dtype, multiply by the weight in that dtype, round again.
The mean is a fixed tree over the hidden size divided by H (fixed_order.tree_sum), so a row's bits
never depend on how many rows share the call.

``add_rmsnorm(x, residual, weight, *, eps) -> (normed, new_residual)`` is the fused layer-boundary
form (``--layer-boundary-norm fused``): the sum ``x + residual`` stays f32 for the norm, while the
residual stream keeps its rounded value. ``unfused`` (the trainer's form) materialises the rounded
sum first and calls ``rmsnorm`` on it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels._twin import torch_twin
from pallas_kernels.fixed_order import tree_sum
from pallas_kernels.registry import Priority, declare_family, register


def _rmsnorm_signature(x, weight, *, eps):
    """x[M, H] bf16|f32, weight[H] -> [M, H] in x's dtype (the HF form)."""


def _add_rmsnorm_signature(x, residual, weight, *, eps, round_sum=False):
    """x, residual [M, H] (x's dtype), weight[H] -> (normed [M, H], new residual [M, H]).

    The new residual is x + residual (an f32 sum) rounded to x's dtype. The norm reads the f32 sum
    itself, or with round_sum the rounded one: then the bits are exactly a separate add in x's
    dtype followed by rmsnorm (the trainer's materialised residual, the `unfused` layer boundary),
    in one launch where a leaf fuses them."""


declare_family("norm", "rmsnorm", _rmsnorm_signature)
declare_family("norm", "add_rmsnorm", _add_rmsnorm_signature)

_INVARIANT = dict(traits={"deterministic": True, "batch_invariant": True},
                  features={"batch_invariant"})


def _sum(x, residual, round_sum: bool):
    """x + residual in f32; round_sum: rounded to x's dtype and widened again (the f32 sum of two
    bf16 values rounded once more to bf16 is their correctly rounded bf16 sum: 24 >= 2 * 8 + 2
    bits, so the double rounding is innocuous -- the bits of `x + residual` in bf16)."""
    total = x.astype(jnp.float32) + residual.astype(jnp.float32)
    return total.astype(x.dtype).astype(jnp.float32) if round_sum else total


def _normalize(xf, eps, mean_of_squares):
    var = mean_of_squares(xf * xf)
    return xf * lax.rsqrt(var + jnp.float32(eps))


def _fixed_mean(sq):
    # An IEEE division by H, as the Triton norm's div_rn. XLA rewrites a division by a constant into
    # a multiply by its reciprocal, inexact unless H is a power of two, and on the CPU then contracts
    # that multiply and the `+ eps` after it into one FMA, while the trainer adds eps as its own op:
    # at DeepSeek-V3's q_lora_rank 1536 about one row in a thousand came out one bf16 ulp apart.
    # It rewrites a division by any broadcast scalar the same way, so the divisor is a whole array
    # of H behind an optimization barrier: not a constant, not a broadcast, and the division stays.
    total = tree_sum(sq, axis=-1)
    h = lax.optimization_barrier(jnp.full(total.shape, sq.shape[-1], jnp.float32))
    return (total / h)[..., None]


def _native_mean(sq):
    return jnp.mean(sq, axis=-1, keepdims=True)


@register("norm", "rmsnorm", "fixed_order", formats={"bf16", "f32"}, hardware={"any"},
          priority=Priority.PORTABLE, **_INVARIANT)
def rmsnorm(x, weight, *, eps):
    normed = _normalize(x.astype(jnp.float32), eps, _fixed_mean).astype(x.dtype)
    return (weight.astype(x.dtype) * normed).astype(x.dtype)


@register("norm", "rmsnorm", "xla_native", formats={"bf16", "f32"}, hardware={"any"},
          priority=Priority.TUNED + 1, traits={"batch_invariant": False})
def rmsnorm_xla_native(x, weight, *, eps):
    normed = _normalize(x.astype(jnp.float32), eps, _native_mean).astype(x.dtype)
    return (weight.astype(x.dtype) * normed).astype(x.dtype)


@register("norm", "add_rmsnorm", "fixed_order", formats={"bf16", "f32"}, hardware={"any"},
          priority=Priority.PORTABLE, **_INVARIANT)
def add_rmsnorm(x, residual, weight, *, eps, round_sum=False):
    total = _sum(x, residual, round_sum)
    normed = _normalize(total, eps, _fixed_mean).astype(x.dtype)
    return (weight.astype(x.dtype) * normed).astype(x.dtype), total.astype(x.dtype)


@register("norm", "add_rmsnorm", "xla_native", formats={"bf16", "f32"}, hardware={"any"},
          priority=Priority.TUNED + 1, traits={"batch_invariant": False})
def add_rmsnorm_xla_native(x, residual, weight, *, eps, round_sum=False):
    total = _sum(x, residual, round_sum)
    normed = _normalize(total, eps, _native_mean).astype(x.dtype)
    return (weight.astype(x.dtype) * normed).astype(x.dtype), total.astype(x.dtype)


def mean_fixed_order(x):
    """The fixed-order mean over the last axis (keepdim): what trainer mode routes ``mean`` to."""
    return _fixed_mean(x.astype(jnp.float32)).astype(x.dtype)


rmsnorm_torch = torch_twin(rmsnorm, static_argnames=("eps",))
mean_fixed_order_torch = torch_twin(mean_fixed_order)
rsqrt_torch = torch_twin(lax.rsqrt)
