"""("moe", "router_topk"): a MoE router's expert choice and routing weights, one leaf per tie order.

Spec ("Router"): the router's probabilities are an fp32 softmax over the router logits; the top k are
taken sorted (largest first), and the routing weights are the selected probabilities, divided by
their fp32 sum when the model normalises them (Qwen3-MoE's `norm_topk_prob`). What differs between
leaves is the order of EXACT ties, which decides the expert at a near-tie bit pattern:

* ``stable`` -- the lowest expert id first among equal probabilities (lax.top_k's documented rule),
  for trainers that impose that tie-break themselves.
* ``torch`` -- PyTorch CUDA's ``topk(sorted=True)`` tie order (``torch_cuda_topk`` below), so the
  engine picks the experts a torch trainer's router picks (``--router-topk torch``).

A launch picks the leaf by feature (registry: features are the buyer's guarantee, a silent leaf is
excluded): ``plan_router_topk(router_topk, hardware=...)`` requires ``torch_tie_order`` for
``--router-topk torch`` and nothing for ``auto`` (the stable leaf then wins on its name).

Every reduction is a fixed-order form (pallas_kernels/fixed_order.py): the max is exact, the
exponentials `fixed_exp`, the sums a pairwise tree over the static expert count, so a token's
experts and weights depend on its own logits only, never on the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._twin import torch_twin
from pallas_kernels.fixed_order import fixed_exp, tree_sum
from pallas_kernels.registry import Priority, declare_family, plan, register


def _router_topk_signature(logits, *, k, norm_topk_prob):
    """logits f32[T, E] (the router GEMM's output, widened) -> (expert ids int32[T, k], routing
    weights f32[T, k]): largest probability first, ties in the leaf's order."""


declare_family("moe", "router_topk", _router_topk_signature)

_BATCH_INVARIANT = dict(formats={"f32"}, hardware={"any"}, priority=Priority.PORTABLE,
                        traits={"deterministic": True, "batch_invariant": True})

# --router-topk -> the features a plan requires beyond batch invariance.
ROUTER_TOPK_FEATURES = {"auto": frozenset(), "torch": frozenset({"torch_tie_order"})}

# torch.topk's CUDA sort after the selection (aten/src/ATen/native/cuda/Sort.cu): a bitonic network
# of 32 slots for k <= 32 (unstable), stable sorts up to 4096; larger k takes other paths.
BITONIC_SLOTS = 32
MAX_TORCH_K = 4096


def router_probabilities(logits: jax.Array) -> jax.Array:
    """fp32 softmax over the last axis: exp(x - max) / sum, the sum a fixed pairwise tree."""
    x = logits.astype(jnp.float32)
    e = fixed_exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / tree_sum(e, axis=-1)[..., None]


def routing_weights(selected: jax.Array, norm_topk_prob: bool) -> jax.Array:
    """The selected probabilities [T, k], divided by their sum (a fixed tree) when normalised."""
    return selected / tree_sum(selected, axis=-1)[..., None] if norm_topk_prob else selected


@register("moe", "router_topk", "stable", features={"batch_invariant", "stable_tie_order"},
          **_BATCH_INVARIANT)
def router_topk_stable(logits, *, k, norm_topk_prob):
    probs = router_probabilities(logits)
    selected, ids = jax.lax.top_k(probs, k)  # equal values: the lower index first (documented)
    return ids.astype(jnp.int32), routing_weights(selected, norm_topk_prob)


# -- PyTorch CUDA's topk(sorted=True) ----------------------------------------------------------------
#
# aten/src/ATen/native/cuda/TensorTopK.cu selects with a radix select on the float's bits and writes
# the selection in index order: first every value above the k-th value, then values equal to it until
# k are written -- so among ties at the cutoff the LOWEST indices win. TensorTopK.cpp then sorts the
# k (value, index) pairs in place, descending (Sort.cu sortKeyValueInplace, stable=false):
#   k <= 32:        SmallBitonicSort: SortUtils.cuh bitonicSort over 32 slots (invalid slots pad the
#                   end), comparator GTOp (NaN largest). bitonicSwap exchanges a pair when
#                   ((a > b && a valid) || !b valid) == dir, so EQUAL keys are exchanged in every
#                   dir=false step: a fixed permutation of exact ties, e.g. 8 equal -> [7,6,4,5,1,0,2,3].
#   32 < k <= 4096: WarpMergeSort / cub radix sort, both stable: ties keep the index order.


def _radix_order_key(p: jax.Array) -> jax.Array:
    """TopKTypeConfig<float>::convert as a signed int32 with the same order: NaN the largest,
    -0.0 below +0.0 (the radix select orders bit patterns, not float values)."""
    bits = jax.lax.bitcast_convert_type(p, jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jnp.where(jnp.isnan(p), jnp.int32(0x7FFFFFFF), key)


def _bitonic_stages():
    """(first slot, second slot, dir) of every compare-exchange step of bitonicSort<32>, as static
    numpy arrays over the 16 threads: `size` 2..16 with dir = thread & size/2, then the final merge
    with dir = false."""
    threads = np.arange(BITONIC_SLOTS // 2)
    steps = [(size, stride) for size in (2, 4, 8, 16) for stride in _halvings(size // 2)]
    steps += [(None, stride) for stride in _halvings(BITONIC_SLOTS // 2)]
    stages = []
    for size, stride in steps:
        first = 2 * threads - (threads & (stride - 1))
        direction = np.zeros_like(threads, bool) if size is None else (threads & (size // 2)) != 0
        stages.append((first, first + stride, direction))
    return tuple(stages)


def _halvings(n: int):
    while n > 0:
        yield n
        n //= 2


_BITONIC_STAGES = _bitonic_stages()


def _bitonic_sort_descending(values: jax.Array, ids: jax.Array):
    """SortUtils.cuh bitonicSort with GTOp on rows of k <= 32 (value, id) pairs, slot for slot."""
    t, k = values.shape
    pad = BITONIC_SLOTS - k
    v = jnp.pad(values, ((0, 0), (0, pad)))
    i = jnp.pad(ids, ((0, 0), (0, pad)))
    valid = jnp.broadcast_to(jnp.arange(BITONIC_SLOTS) < k, (t, BITONIC_SLOTS))
    for first, second, direction in _BITONIC_STAGES:
        back = np.argsort(np.concatenate([first, second]))  # the stage's pairs cover all 32 slots
        va, vb = v[:, first], v[:, second]
        ok_a, ok_b = valid[:, first], valid[:, second]
        greater = (jnp.isnan(va) & ~jnp.isnan(vb)) | (va > vb)
        exchange = ((greater & ok_a) | ~ok_b) == direction
        v, i, valid = (
            jnp.concatenate([jnp.where(exchange, b, a), jnp.where(exchange, a, b)], axis=-1)[:, back]
            for a, b in ((va, vb), (i[:, first], i[:, second]), (ok_a, ok_b)))
    return v[:, :k], i[:, :k]


def torch_cuda_topk(probs: jax.Array, k: int):
    """torch.topk(probs, k, sorted=True) as PyTorch CUDA returns it: (values f32[T, k],
    ids int32[T, k]). Row-local static ops only, so a row's result never depends on the batch."""
    n = probs.shape[-1]
    if not 1 <= k <= min(n, MAX_TORCH_K):
        raise ValueError(f"router_topk torch: k={k} must be in [1, {min(n, MAX_TORCH_K)}] (the "
                         f"expert count is {n}; PyTorch's in-place sort serves k <= {MAX_TORCH_K})")
    keys, ids, values = _radix_select(probs, k)
    if k > BITONIC_SLOTS:
        return values, ids  # stable sorts of the index-ordered selection: ties stay index-ordered
    return _bitonic_sort_descending(*_write_order(keys, ids, values))


def torch_cuda_topk_unsorted(values: jax.Array, k: int):
    """torch.topk(values, k, sorted=False) as PyTorch CUDA returns it: (values f32[T, k], ids
    int32[T, k]) in the radix select's write order, with no sort after it -- every value above the
    k-th by ascending index, then the values equal to the k-th by ascending index (measured on the
    H200, reference notes 5.1: rows of 8 to 768 with -inf masks and ties)."""
    n = values.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"topk unsorted: k={k} must be in [1, {n}] (the row has {n} values)")
    keys, ids, selected = _radix_select(values, k)
    return _write_order(keys, ids, selected)


def _radix_select(values: jax.Array, k: int):
    """The selection: largest radix key first, the lowest index among equal keys (lax.top_k's
    rule) -> (keys, ids int32, values) of the k selected, largest key first."""
    keys, ids = jax.lax.top_k(_radix_order_key(values), k)
    ids = ids.astype(jnp.int32)
    return keys, ids, jnp.take_along_axis(values, ids, axis=-1)


def _write_order(keys, ids, values):
    """The gather's write order: above the k-th key by index, then equal to it by index."""
    at_cutoff = (keys == keys[:, -1:]).astype(jnp.int32)
    _, ids, values = jax.lax.sort((at_cutoff, ids, values), num_keys=2)
    return values, ids


@register("moe", "router_topk", "torch", features={"batch_invariant", "torch_tie_order"},
          **_BATCH_INVARIANT)
def router_topk_torch(logits, *, k, norm_topk_prob):
    selected, ids = torch_cuda_topk(router_probabilities(logits), k)
    return ids, routing_weights(selected, norm_topk_prob)


# The trainer-side twin: the same compiled program, called from torch (pallas_kernels/_twin.py).
router_topk_torch_torch = torch_twin(router_topk_torch, static_argnames=("k", "norm_topk_prob"))


def plan_router_topk(router_topk: str, *, hardware: str):
    """The frozen ("moe", "router_topk") plan a model uses under ``--router-topk router_topk``."""
    if router_topk not in ROUTER_TOPK_FEATURES:
        raise ValueError(f"router_topk={router_topk!r} is not one of {sorted(ROUTER_TOPK_FEATURES)}")
    return plan("moe", "router_topk", formats={"f32"}, hardware=hardware,
                features={"batch_invariant"} | ROUTER_TOPK_FEATURES[router_topk])
