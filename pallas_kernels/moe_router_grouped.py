"""("moe", "router_grouped_topk"): the correction-bias router (DeepSeek-V3's noaux_tc, LongCat-Flash's
router), one leaf per tie order, in HF transformers 5.24's operation order and dtypes.

``DeepseekV3TopkRouter.forward`` (and ``LongcatFlashTopkRouter``'s, which is the same with a softmax
and one group), every step in f32:

    logits   = x.float() @ W.float()^T              the gate GEMM in f32 (the caller's plan)
    scores   = sigmoid(logits)                      LongCat: softmax(logits)
    choice   = scores + e_score_correction_bias     used for the choice only
    group    = top-2 of each of n_group groups of choice, summed
    groups   = topk(group, topk_group, sorted=False)             a mask; order irrelevant
    masked   = choice, -inf outside the chosen groups
    ids      = topk(masked, k, sorted=False)
    weights  = scores gathered at ids                           UNBIASED scores
    weights /= sum(weights) + 1e-20                              when norm_topk_prob
    weights *= routed_scaling_factor                             an f32 scalar multiply

What the leaves pin, because torch leaves it to the device:

* the scores: ``1 / (1 + fixed_exp(-x))`` and moe_router's fixed-order softmax, so a row's bits
  never depend on its batch (torch's CPU and CUDA sigmoids are other polynomials; trainer mode runs
  this leaf's twin in HF's router instead, interop/trainer_moe.py);
* which experts at an exact tie, and their slot order. ``torch``: PyTorch CUDA's
  ``topk(sorted=False)`` -- the radix select's write order, values above the k-th by ascending id
  then the tied k-th values by ascending id, the lowest ids winning at the cutoff
  (moe_router.torch_cuda_topk_unsorted). ``stable``: largest first, the lowest id first among
  equal values (lax.top_k). The group choice is a mask, so both take the lowest group ids at a tie,
  which is also what CUDA selects;
* the normalising sum: PyTorch CUDA's reduction of a contiguous f32 row of k <= 8 values is
  ``(a0 + a2) + (a1 + a3)`` with ``a_r = x_r + x_{r+4}`` (measured on the H200 for k = 3..8 and
  1..20000 rows: every row bit-equal; sequential and pairwise orders are not). Both leaves use it
  over their own slot order; k > 8 with norm_topk_prob is refused (unmeasured).

Every other step is one correctly rounded IEEE operation, the same in torch and XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._twin import torch_twin
from pallas_kernels.fixed_order import fixed_exp
from pallas_kernels.moe_router import ROUTER_TOPK_FEATURES, router_probabilities, \
    torch_cuda_topk_unsorted
from pallas_kernels.registry import Priority, declare_family, plan, register

SCORES = ("sigmoid", "softmax")
NORM_EPSILON = 1e-20  # HF's `topk_weights.sum(-1) + 1e-20`
MAX_NORM_K = 8  # the largest k whose CUDA row-sum order was measured


def _router_grouped_topk_signature(logits, bias, *, k, n_group, topk_group, norm_topk_prob,
                                   routed_scaling_factor, score):
    """logits f32[T, E] (the f32 gate GEMM), bias f32[E] (e_score_correction_bias) -> (expert ids
    int32[T, k], routing weights f32[T, k]) in the leaf's slot order; score "sigmoid" | "softmax"."""


declare_family("moe", "router_grouped_topk", _router_grouped_topk_signature)

_BATCH_INVARIANT = dict(formats={"f32"}, hardware={"any"}, priority=Priority.PORTABLE,
                        traits={"deterministic": True, "batch_invariant": True})


def scores_of(logits: jax.Array, score: str) -> jax.Array:
    """f32 router scores: sigmoid as 1 / (1 + exp(-x)) with the fixed-order exp, or the softmax."""
    x = logits.astype(jnp.float32)
    if score == "sigmoid":
        return jnp.float32(1.0) / (jnp.float32(1.0) + fixed_exp(-x))
    if score == "softmax":
        return router_probabilities(x)
    raise ValueError(f"router_grouped_topk: score={score!r} is not one of {SCORES}")


def torch_cuda_row_sum(x: jax.Array) -> jax.Array:
    """f32[T, k] -> f32[T]: torch.sum(x, -1) as PyTorch CUDA adds a contiguous row of k <= 8."""
    k = x.shape[-1]
    if k > MAX_NORM_K:
        raise ValueError(f"router_grouped_topk: norm_topk_prob with k={k}: PyTorch CUDA's sum order "
                         f"is measured for k <= {MAX_NORM_K} only")
    a = []
    for r in range(min(k, 4)):
        a.append(x[:, r] if r + 4 >= k else x[:, r] + x[:, r + 4])
    left = a[0] if len(a) < 3 else a[0] + a[2]
    right = None if len(a) < 2 else (a[1] if len(a) < 4 else a[1] + a[3])
    return left if right is None else left + right


def _check(e: int, k: int, n_group: int, topk_group: int) -> None:
    if n_group < 1 or e % n_group:
        raise ValueError(f"router_grouped_topk: n_group={n_group} must divide the expert count {e}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"router_grouped_topk: topk_group={topk_group} must be in [1, {n_group}]")
    if n_group > 1 and e // n_group < 2:
        raise ValueError(f"router_grouped_topk: groups of {e // n_group} expert (n_group={n_group}, "
                         f"{e} experts); a group's score is its top-2 sum")
    if not 1 <= k <= topk_group * (e // n_group):
        raise ValueError(f"router_grouped_topk: k={k} must be in [1, {topk_group * (e // n_group)}] "
                         f"(the experts of topk_group={topk_group} groups of {e // n_group})")


def _choice(logits, bias, *, k, n_group, topk_group, score):
    """(scores f32[T, E], the choice scores: scores + bias, -inf outside the chosen groups)."""
    t, e = logits.shape
    _check(e, k, n_group, topk_group)
    scores = scores_of(logits, score)
    choice = scores + bias.astype(jnp.float32)[None, :]
    if topk_group == n_group:  # every group chosen (LongCat, n_group = 1): HF's mask is all true
        return scores, choice
    grouped = choice.reshape(t, n_group, e // n_group)
    top2 = jax.lax.top_k(grouped, 2)[0]
    group_scores = top2[..., 0] + top2[..., 1]                      # one add: order-free
    _, chosen = torch_cuda_topk_unsorted(group_scores, topk_group)  # lowest group ids at a tie
    keep = (chosen[:, :, None] == jnp.arange(n_group)).any(axis=1)     # [T, n_group]
    masked = jnp.where(keep[:, :, None], grouped, jnp.float32(-jnp.inf)).reshape(t, e)
    return scores, masked


def _weights(scores, ids, *, norm_topk_prob, routed_scaling_factor):
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        # One [T] / [T] division per slot: XLA rewrites a division by a broadcast denominator into
        # a multiply by its reciprocal (two roundings; HF's `/=` is one).
        denominator = torch_cuda_row_sum(weights) + jnp.float32(NORM_EPSILON)
        weights = jnp.stack([weights[:, s] / denominator for s in range(ids.shape[-1])], axis=-1)
    return weights * jnp.float32(routed_scaling_factor)


@register("moe", "router_grouped_topk", "stable",
          features={"batch_invariant", "stable_tie_order"}, **_BATCH_INVARIANT)
def router_grouped_topk_stable(logits, bias, *, k, n_group, topk_group, norm_topk_prob,
                               routed_scaling_factor, score):
    scores, choice = _choice(logits, bias, k=k, n_group=n_group, topk_group=topk_group,
                             score=score)
    ids = jax.lax.top_k(choice, k)[1].astype(jnp.int32)  # equal values: the lower id first
    return ids, _weights(scores, ids, norm_topk_prob=norm_topk_prob,
                         routed_scaling_factor=routed_scaling_factor)


@register("moe", "router_grouped_topk", "torch",
          features={"batch_invariant", "torch_tie_order"}, **_BATCH_INVARIANT)
def router_grouped_topk_torch(logits, bias, *, k, n_group, topk_group, norm_topk_prob,
                              routed_scaling_factor, score):
    scores, choice = _choice(logits, bias, k=k, n_group=n_group, topk_group=topk_group,
                             score=score)
    _, ids = torch_cuda_topk_unsorted(choice, k)
    return ids, _weights(scores, ids, norm_topk_prob=norm_topk_prob,
                         routed_scaling_factor=routed_scaling_factor)


_STATIC = ("k", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "score")

# The trainer-side twin: the same compiled program, called from torch (pallas_kernels/_twin.py).
router_grouped_topk_torch_torch = torch_twin(router_grouped_topk_torch, static_argnames=_STATIC)


def plan_router_grouped_topk(router_topk: str, *, hardware: str, features=frozenset()):
    """The frozen ("moe", "router_grouped_topk") plan under ``--router-topk router_topk``:
    ``torch`` requires PyTorch CUDA's tie order, ``auto`` nothing (the stable leaf wins on its
    name), both on top of the launch's ``features`` (batch_invariant under rl-bitwise)."""
    if router_topk not in ROUTER_TOPK_FEATURES:
        raise ValueError(f"router_topk={router_topk!r} is not one of {sorted(ROUTER_TOPK_FEATURES)}")
    return plan("moe", "router_grouped_topk", formats={"f32"}, hardware=hardware,
                features=frozenset(features) | ROUTER_TOPK_FEATURES[router_topk])
