"""("moe", "router_topk"): a MoE router's expert choice and routing weights, one leaf per tie order.

Spec ("Router"): the router's probabilities are an fp32 softmax over the router logits; the top k are
taken sorted (largest first), and the routing weights are the selected probabilities, divided by
their fp32 sum when the model normalises them (Qwen3-MoE's `norm_topk_prob`). What differs between
leaves is the order of EXACT ties, which decides the expert at a near-tie bit pattern:

* ``stable`` — the lowest expert id first among equal probabilities (lax.top_k's documented rule),
  for trainers that impose that tie-break themselves.
* ``torch`` — PyTorch CUDA's `topk(sorted=True)` tie order (issue #18; not in this module yet).

Every reduction is a fixed-order form (pallas_kernels/fixed_order.py): the max is exact, the
exponentials `fixed_exp`, the sums a pairwise tree over the static expert count, so a token's
experts and weights depend on its own logits only, never on the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fixed_order import fixed_exp, tree_sum
from pallas_kernels.registry import Priority, declare_family, register


def _router_topk_signature(logits, *, k, norm_topk_prob):
    """logits f32[T, E] (the router GEMM's output, widened) -> (expert ids int32[T, k], routing
    weights f32[T, k]): largest probability first, ties in the leaf's order."""


declare_family("moe", "router_topk", _router_topk_signature)

_BATCH_INVARIANT = dict(formats={"f32"}, hardware={"any"}, priority=Priority.PORTABLE,
                        features={"batch_invariant"},
                        traits={"deterministic": True, "batch_invariant": True})


def router_probabilities(logits: jax.Array) -> jax.Array:
    """fp32 softmax over the last axis: exp(x - max) / sum, the sum a fixed pairwise tree."""
    x = logits.astype(jnp.float32)
    e = fixed_exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / tree_sum(e, axis=-1)[..., None]


def routing_weights(selected: jax.Array, norm_topk_prob: bool) -> jax.Array:
    """The selected probabilities [T, k], divided by their sum (a fixed tree) when normalised."""
    return selected / tree_sum(selected, axis=-1)[..., None] if norm_topk_prob else selected


@register("moe", "router_topk", "stable", **_BATCH_INVARIANT)
def router_topk_stable(logits, *, k, norm_topk_prob):
    probs = router_probabilities(logits)
    selected, ids = jax.lax.top_k(probs, k)  # equal values: the lower index first (documented)
    return ids.astype(jnp.int32), routing_weights(selected, norm_topk_prob)
