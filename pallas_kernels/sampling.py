"""Token choice: the canonical greedy argmax and the per-request Gumbel-max sampler.

Both are leaves with the `batch_invariant` feature: a row's token depends only on that row's logits
and sampling parameters, never on the batch around it (spec: "sampling.deterministic").

* Greedy rows take the canonical argmax: the lowest index among EXACTLY equal maxima (exact logit
  ties happen in practice), with -0.0 and +0.0 one key. NaN policy: a row holding a NaN returns the
  lowest NaN index (what numpy.argmax and torch.argmax do), so a broken row is visible instead of
  being silently sampled around.
* Sampled rows draw Gumbel-max noise keyed ONLY by (request seed, absolute position of the token
  being sampled): threefry2x32, `fold_in(key(seed), position)`, which gives the same bits alone, under
  vmap and in any batch. Never the batch row or the step counter, so a request draws the same token
  wherever and whenever it lands (packed, chunked, after a prefix hit or a retraction).
* Filtering follows SGLang's torch sampler: probabilities of the temperature-scaled logits, then
  top-k, top-p (on the cumulative sorted probabilities) and min-p masks, combined; every sum is a
  fixed-order tree or scan from pallas_kernels.logprobs, sorting is exact, comparisons are exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.logprobs import canonical_row_max, inclusive_scan_last, tree_sum_last
from pallas_kernels.registry import Priority, declare_family, register


def _argmax_signature(logits):
    """f32[R, V] -> int32[R], the canonical argmax of each row."""


def _gumbel_signature(logits, temperature, top_k, top_p, min_p, seed, position, *,
                      use_top_k=True, use_top_p=True):
    """f32[R, V] logits and per-row [R] parameters, seed and position -> int32[R] tokens."""


declare_family("sampling", "argmax", _argmax_signature)
declare_family("sampling", "gumbel", _gumbel_signature)

_BATCH_INVARIANT = dict(formats={"f32"}, hardware={"any"}, priority=Priority.PORTABLE,
                        features={"batch_invariant"},
                        traits={"deterministic": True, "batch_invariant": True})


def canonical_argmax(logits: jax.Array) -> jax.Array:
    """int32[R]: lowest index of the row max (signed zeros equal; a NaN row -> its first NaN)."""
    x = logits.astype(jnp.float32)
    vocab = x.shape[-1]
    nan = jnp.isnan(x)
    best = jnp.max(jnp.where(nan, -jnp.inf, x), axis=-1, keepdims=True)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == best)  # 0.0 == -0.0
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    # min over indices is exact and order-free: no tie can resolve differently with the batch.
    return jnp.min(jnp.where(hit, iota, vocab), axis=-1).astype(jnp.int32)


register("sampling", "argmax", "canonical", **_BATCH_INVARIANT)(canonical_argmax)


def gumbel_noise(seed: jax.Array, position: jax.Array, vocab: int) -> jax.Array:
    """f32[R, V] standard Gumbel noise, row r keyed only by (seed[r], position[r])."""

    def row_bits(s, p):
        key = jax.random.fold_in(jax.random.key(s, impl="threefry2x32"), p)
        return jax.random.bits(key, (vocab,), jnp.uint32)

    bits = jax.vmap(row_bits)(seed.astype(jnp.uint32), position.astype(jnp.int32))
    # u in (0, 1) from the top 23 bits: int->float, +0.5 and a power-of-two scale are all exact,
    # so there is no multiply-add for XLA to contract and u is never 0 or 1.
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (2.0 ** -23)
    return -jnp.log(-jnp.log(u))


def filter_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, *,
                use_top_k: bool, use_top_p: bool) -> jax.Array:
    """bool[R, V]: tokens that survive top-k, top-p and min-p on temperature-scaled logits.

    Thresholds are values, so tokens tied with the last kept one are all kept. The row max always
    survives. top_k <= 0 or >= V, top_p >= 1 and min_p <= 0 switch a filter off for that row; the
    `use_*` flags drop the sort when no row needs it (a disabled filter keeps every token, so the
    result is bit-identical either way).
    """
    vocab = scaled.shape[-1]
    e = jnp.exp(scaled - canonical_row_max(scaled))  # unnormalised probabilities, max entry 1.0
    # min-p: p_i >= min_p * p_max  <=>  e_i >= min_p  (p_max = 1/S, p_i = e_i/S); no sum needed.
    keep = e >= min_p[:, None]
    if not (use_top_k or use_top_p):
        return keep
    desc = -jnp.sort(-scaled, axis=-1)  # exact permutation of the row, largest first
    if use_top_k:
        k_on = (top_k > 0) & (top_k < vocab)
        kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
        keep &= ~k_on[:, None] | (scaled >= kth)
    if use_top_p:
        e_desc = jnp.exp(desc - canonical_row_max(scaled))
        total = tree_sum_last(e)[:, None]
        # Mass strictly before each sorted token: the inclusive scan shifted right by one (exact).
        incl = inclusive_scan_last(e_desc)
        before = jnp.concatenate([jnp.zeros_like(incl[:, :1]), incl[:, :-1]], axis=-1)
        # SGLang: drop a sorted token when the mass before it exceeds top_p (the first always stays).
        n_keep = jnp.sum((before <= top_p[:, None] * total).astype(jnp.int32), axis=-1)
        last = jnp.take_along_axis(desc, jnp.maximum(n_keep - 1, 0)[:, None], axis=-1)
        keep &= (top_p >= 1.0)[:, None] | (scaled >= last)
    return keep


def gumbel_sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, seed: jax.Array, position: jax.Array, *,
                  use_top_k: bool = True, use_top_p: bool = True) -> jax.Array:
    """int32[R]: greedy rows (temperature 0) -> canonical argmax; others -> Gumbel-max draw."""
    x = logits.astype(jnp.float32)
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)[:, None]
    scaled = x / t  # a division, not a multiply by 1/t: nothing to contract into an FMA
    keep = filter_mask(scaled, top_k, top_p, min_p, use_top_k=use_top_k, use_top_p=use_top_p)
    noisy = jnp.where(keep, scaled + gumbel_noise(seed, position, x.shape[-1]), -jnp.inf)
    return jnp.where(greedy, canonical_argmax(x), canonical_argmax(noisy)).astype(jnp.int32)


register("sampling", "gumbel", "per_request", **_BATCH_INVARIANT)(gumbel_sample)
