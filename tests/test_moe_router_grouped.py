"""("moe", "router_grouped_topk"): the correction-bias router against HF transformers'
`DeepseekV3TopkRouter` on the CPU, and the tie and reduction orders PyTorch CUDA was measured to use
(pallas_kernels/moe_router_grouped.py). Bitwise claims compare float bits.

HF on the CPU differs from the leaf in three places, none of them HF's arithmetic: its sigmoid (a
torch CPU polynomial; the comparisons feed HF the leaf's scores through `Tensor.sigmoid`), the slot
order of `topk(sorted=False)` (CPU's is unspecified: ids are compared per expert) and the order of
its normalising sum (CPU's, not CUDA's: compared where it cannot matter, k = 2).
"""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pallas_kernels import moe_router_grouped as grouped
from pallas_kernels.moe_router_grouped import (plan_router_grouped_topk, router_grouped_topk_stable,
                                               router_grouped_topk_torch, torch_cuda_row_sum)
from tests.bits import count_bit_differences

_TORCH = jax.jit(router_grouped_topk_torch, static_argnames=grouped._STATIC)
_STABLE = jax.jit(router_grouped_topk_stable, static_argnames=grouped._STATIC)
_SCORES = jax.jit(grouped.scores_of, static_argnames="score")

# (experts, groups, chosen groups, k): DeepSeek-V3's 256/8/4/8 and smaller shapes; n_group 1 = no
# group limit (LongCat's form).
SHAPES = [(16, 1, 1, 4), (16, 4, 2, 2), (64, 8, 4, 8), (64, 4, 1, 6), (256, 8, 4, 8)]


def _hf_router(e, n_group, topk_group, k, *, norm, scale=2.5, seed=0, hidden=16):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(hidden_size=hidden, n_routed_experts=e,
                                        num_experts_per_tok=k, n_group=n_group,
                                        topk_group=topk_group, norm_topk_prob=norm,
                                        routed_scaling_factor=scale)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, hidden, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.05)
    return router


def _scores_sigmoid(t):
    """Tensor.sigmoid -> the leaf's scores, so HF's router sees the leaf's bits."""
    return torch.from_numpy(np.array(_SCORES(jnp.asarray(t.detach().numpy()), score="sigmoid")))


def _run_hf(router, x):
    with mock.patch.object(torch.Tensor, "sigmoid", _scores_sigmoid), torch.no_grad():
        logits, weights, ids = router(x)
    return logits, weights.numpy(), ids.numpy()


def _leaf(fn, router, logits, k, *, norm, scale=2.5):
    ids, w = fn(jnp.asarray(logits.numpy()), jnp.asarray(router.e_score_correction_bias.numpy()),
                k=k, n_group=router.num_group, topk_group=router.topk_group, norm_topk_prob=norm,
                routed_scaling_factor=scale, score="sigmoid")
    return np.asarray(ids), np.asarray(w)


def _by_expert(ids, weights):
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize("e,n_group,topk_group,k", SHAPES, ids=[f"E{s[0]}g{s[1]}" for s in SHAPES])
def test_random_rows_equal_hf_per_expert(e, n_group, topk_group, k):
    """Same experts as HF; each expert's weight bit-equal (no normalisation: gather and scale)."""
    router = _hf_router(e, n_group, topk_group, k, norm=False)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(e + k))
    logits, hf_w, hf_ids = _run_hf(router, x)
    for fn in (_TORCH, _STABLE):
        ids, w = _leaf(fn, router, logits, k, norm=False)
        want_ids, want_w = _by_expert(hf_ids, hf_w)
        got_ids, got_w = _by_expert(ids, w)
        assert (got_ids == want_ids).all()
        assert count_bit_differences(got_w, want_w) == 0


def test_normalised_weights_equal_hf_at_k2():
    """norm_topk_prob: HF's (w / (sum + 1e-20)) * scale; at k = 2 every sum order is one add."""
    router = _hf_router(64, 8, 2, 2, norm=True, scale=2.827)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(5))
    logits, hf_w, hf_ids = _run_hf(router, x)
    ids, w = _leaf(_TORCH, router, logits, 2, norm=True, scale=2.827)
    (got_ids, got_w), (want_ids, want_w) = _by_expert(ids, w), _by_expert(hf_ids, hf_w)
    assert (got_ids == want_ids).all() and count_bit_differences(got_w, want_w) == 0


def test_cuda_row_sum_order():
    """The measured CUDA order (a0 + a2) + (a1 + a3), a_r = x_r + x_{r+4}; a sequential sum (the
    control) differs on these rows."""
    x = (np.random.default_rng(0).random((2000, 8)) * np.exp(
        np.random.default_rng(1).normal(0, 3, (2000, 8)))).astype(np.float32)
    a = [x[:, r] + x[:, r + 4] for r in range(4)]
    want = (a[0] + a[2]) + (a[1] + a[3])
    got = np.asarray(jax.jit(torch_cuda_row_sum)(jnp.asarray(x)))
    assert count_bit_differences(got, want) == 0
    sequential = x[:, 0].copy()
    for j in range(1, 8):
        sequential = sequential + x[:, j]
    assert count_bit_differences(got, sequential) > 0
    with pytest.raises(ValueError, match="k=9"):
        torch_cuda_row_sum(jnp.zeros((1, 9)))


def _tied(e, n_group, rows):
    """Logits whose scores tie: equal logits, and a zero bias."""
    return jnp.asarray(rows, jnp.float32).reshape(-1, e), jnp.zeros((e,), jnp.float32)


def _route(fn, logits, bias, *, k, n_group, topk_group):
    ids, _ = fn(logits, bias, k=k, n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                routed_scaling_factor=1.0, score="sigmoid")
    return np.asarray(ids).tolist()


def test_ties_follow_cuda_write_order_and_lowest_ids():
    # All equal, no groups: the lowest ids win; CUDA sorted=False writes them in index order.
    logits, bias = _tied(16, 1, np.zeros(16))
    assert _route(_TORCH, logits, bias, k=4, n_group=1, topk_group=1) == [[0, 1, 2, 3]]
    # Above the cutoff by index, then the tied k-th values by index (measured write order).
    row = np.zeros(16)
    row[[9, 2]] = 3.0
    row[[5, 7, 11]] = 1.0
    logits, bias = _tied(16, 1, row)
    assert _route(_TORCH, logits, bias, k=4, n_group=1, topk_group=1) == [[2, 9, 5, 7]]
    assert _route(_STABLE, logits, bias, k=4, n_group=1, topk_group=1) == [[2, 9, 5, 7]]
    row[2] = 4.0  # the stable leaf sorts by value; the torch leaf keeps index order above the k-th
    logits, _ = _tied(16, 1, row)
    assert _route(_TORCH, logits, bias, k=4, n_group=1, topk_group=1) == [[2, 9, 5, 7]]
    row[9], row[2] = 4.0, 3.0
    logits, _ = _tied(16, 1, row)
    assert _route(_TORCH, logits, bias, k=4, n_group=1, topk_group=1) == [[2, 9, 5, 7]]
    assert _route(_STABLE, logits, bias, k=4, n_group=1, topk_group=1) == [[9, 2, 5, 7]]


def test_group_ties_keep_the_lowest_groups():
    """Four groups of four with equal top-2 sums: topk_group = 2 keeps groups 0 and 1. A bias on
    expert 12 lifts group 3 and expert 12; the weights stay the unbiased scores."""
    row = np.tile([2.0, 2.0, 0.0, 0.0], 4)
    logits, bias = _tied(16, 4, row)
    assert _route(_TORCH, logits, bias, k=4, n_group=4, topk_group=2) == [[0, 1, 4, 5]]
    assert _route(_STABLE, logits, bias, k=4, n_group=4, topk_group=2) == [[0, 1, 4, 5]]
    bias = jnp.zeros((16,), jnp.float32).at[12].set(0.5)
    ids, w = _TORCH(logits, bias, k=4, n_group=4, topk_group=2, norm_topk_prob=False,
                    routed_scaling_factor=1.0, score="sigmoid")
    assert np.asarray(ids).tolist() == [[12, 0, 1, 13]]
    scores = np.asarray(_SCORES(logits, score="sigmoid"))
    assert count_bit_differences(w, scores[:, [12, 0, 1, 13]]) == 0


def test_near_ties_and_rows_batch_invariant():
    """Rows one ulp apart route by their bits, and a row alone equals the row in a batch."""
    base = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    near = np.stack([base, base, base])
    near[1, 7] = np.nextafter(near[1, 7], np.float32(np.inf))
    rows = np.concatenate([near, np.random.default_rng(4).standard_normal((29, 64))]).astype(
        np.float32)
    bias = jnp.asarray(np.random.default_rng(5).standard_normal(64).astype(np.float32) * 0.01)
    kw = dict(k=8, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
              score="sigmoid")
    ids_b, w_b = (np.asarray(a) for a in _TORCH(jnp.asarray(rows), bias, **kw))
    for i in range(len(rows)):
        ids_1, w_1 = _TORCH(jnp.asarray(rows[i:i + 1]), bias, **kw)
        assert (np.asarray(ids_1)[0] == ids_b[i]).all()
        assert count_bit_differences(w_1[0], w_b[i]) == 0


def test_refusals_and_plans():
    bias = jnp.zeros((16,), jnp.float32)
    with pytest.raises(ValueError, match="n_group=3 must divide"):
        _TORCH(jnp.zeros((1, 16)), bias, k=2, n_group=3, topk_group=1, norm_topk_prob=False,
               routed_scaling_factor=1.0, score="sigmoid")
    with pytest.raises(ValueError, match="k=9 must be in"):
        _TORCH(jnp.zeros((1, 16)), bias, k=9, n_group=4, topk_group=2, norm_topk_prob=False,
               routed_scaling_factor=1.0, score="sigmoid")
    with pytest.raises(ValueError, match="score='relu'"):
        grouped.scores_of(jnp.zeros((1, 4)), "relu")
    assert plan_router_grouped_topk("torch", hardware="cpu").leaf.impl == "torch"
    assert plan_router_grouped_topk("auto", hardware="gpu").leaf.impl == "stable"
