"""("moe", "router_topk"): the torch leaf reproduces PyTorch CUDA's topk tie order, row by row, and
trainer mode runs its twin inside HF's Qwen3-MoE router. Bitwise claims compare float bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from interop import trainer_mode
from interop.convert import tensor_to_numpy
from pallas_kernels import moe_router
from pallas_kernels.moe_router import (plan_router_topk, router_topk_stable, router_topk_torch,
                                       router_topk_torch_torch, torch_cuda_topk)
from pallas_kernels.registry import KernelPlanError
from scripts.gpu_router_topk import MEASURED_CUDA_PATTERNS, case_logits, pattern_row
from tests.bits import count_bit_differences

_TOPK = jax.jit(torch_cuda_topk, static_argnums=1)
_LEAF = jax.jit(router_topk_torch, static_argnames=("k", "norm_topk_prob"))
_STABLE = jax.jit(router_topk_stable, static_argnames=("k", "norm_topk_prob"))


def _ids(probs, k):
    return np.asarray(_TOPK(jnp.asarray(probs, jnp.float32), k)[1])


@pytest.mark.parametrize("name,n,tied,k,want", MEASURED_CUDA_PATTERNS,
                         ids=[p[0] for p in MEASURED_CUDA_PATTERNS])
def test_measured_cuda_patterns(name, n, tied, k, want):
    assert _ids(pattern_row(n, tied)[None], k)[0].tolist() == want


def test_cutoff_ties_lowest_index_wins_then_network_order():
    # CUDA's radix select keeps the lowest tied indices at the cutoff ({5,9,100,200} k=2 -> {5,9},
    # measured); values above the cutoff come first whatever their index.
    row = pattern_row(256, (5, 9, 100, 200))
    assert sorted(_ids(row[None], 2)[0].tolist()) == [5, 9]
    row[200] = 2.0
    assert _ids(row[None], 3)[0].tolist() == [200, 9, 5]


def test_untied_rows_sorted_and_weights_gathered():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32) * 3)
    probs = np.asarray(jax.jit(moe_router.router_probabilities)(logits))
    ids, weights = _LEAF(logits, k=8, norm_topk_prob=False)
    assert (np.asarray(ids) == np.argsort(-probs, axis=-1, kind="stable")[:, :8]).all()
    assert count_bit_differences(weights, np.take_along_axis(probs, np.asarray(ids), -1)) == 0
    stable = _STABLE(logits, k=8, norm_topk_prob=False)  # without ties the two leaves agree
    assert (np.asarray(stable[0]) == np.asarray(ids)).all()
    assert count_bit_differences(stable[1], weights) == 0


@pytest.mark.parametrize("k", (2, 33))
def test_row_alone_equals_row_in_shuffled_batch(k):
    rng = np.random.default_rng(k)
    rows = np.concatenate(list(case_logits(64, k, rng).values()))
    batch = np.concatenate([rows, rng.standard_normal((93, 64)).astype(np.float32)])
    perm = rng.permutation(len(batch))
    ids_b, w_b = (np.asarray(a)[np.argsort(perm)] for a in
                  _LEAF(jnp.asarray(batch[perm]), k=k, norm_topk_prob=True))
    for i in range(len(rows)):
        ids_1, w_1 = _LEAF(jnp.asarray(rows[i:i + 1]), k=k, norm_topk_prob=True)
        assert (np.asarray(ids_1)[0] == ids_b[i]).all()
        assert count_bit_differences(w_1[0], w_b[i]) == 0


def test_refuses_k_beyond_torch_or_expert_count():
    with pytest.raises(ValueError, match="k=9 must be in"):
        torch_cuda_topk(jnp.zeros((1, 8)), 9)
    with pytest.raises(ValueError, match="k=4097 must be in"):
        torch_cuda_topk(jnp.zeros((1, 5000)), 4097)


def test_router_topk_switch_plans_the_leaf_by_feature():
    assert plan_router_topk("torch", hardware="cpu").leaf.impl == "torch"
    assert plan_router_topk("auto", hardware="gpu").leaf.impl == "stable"
    with pytest.raises(ValueError, match="router_topk='bitonic'"):
        plan_router_topk("bitonic", hardware="cpu")
    with pytest.raises(KernelPlanError, match="torch_tie_order"):
        moe_router.plan("moe", "router_topk", formats={"bf16"}, hardware="cpu",
                        features={"torch_tie_order"})


def test_twin_equals_leaf_bits():
    logits = np.asarray(case_logits(8, 2, np.random.default_rng(3))["cutoff-tied"])
    ids, weights = router_topk_torch_torch(torch.from_numpy(logits), k=2, norm_topk_prob=True)
    want = _LEAF(jnp.asarray(logits), k=2, norm_topk_prob=True)
    assert (tensor_to_numpy(ids) == np.asarray(want[0])).all()
    assert count_bit_differences(tensor_to_numpy(weights), want[1]) == 0


@pytest.fixture(scope="module")
def qwen3_moe():
    """A tiny random bf16 HF Qwen3-MoE (8 experts, top-4): its first router's gate rows 1, 4 and 6
    are equal, so their logits tie exactly on every token."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.weight.normal_(0, 0.5)
        gate.weight[4] = gate.weight[6] = gate.weight[1]
    return model


def test_trainer_mode_routes_hf_router_to_the_leaf(qwen3_moe):
    gate = qwen3_moe.model.layers[0].mlp.gate
    hidden = torch.randn(24, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with trainer_mode.enable(device="cpu") as mode:
        assert mode.route_moe_routers(qwen3_moe) == 1
        logits, weights, ids = gate(hidden)
        assert mode.routed["router_topk"] == 1
    assert "forward" not in vars(gate)  # leaving trainer mode restores HF's router
    want_ids, want_w = _LEAF(jnp.asarray(tensor_to_numpy(logits.float())), k=4, norm_topk_prob=True)
    assert ids.dtype == torch.int64 and (tensor_to_numpy(ids) == np.asarray(want_ids)).all()
    assert count_bit_differences(tensor_to_numpy(weights), np.asarray(want_w).astype(jnp.bfloat16)) == 0
    # The planted tie decided experts: some token selected two of {1, 4, 6} in the network's order.
    tied = [(r.index(a), r.index(b)) for r in tensor_to_numpy(ids).tolist()
            for a, b in ((1, 4), (4, 6), (1, 6)) if a in r and b in r]
    assert tied


def test_trainer_mode_router_has_a_gradient(qwen3_moe):
    gate = qwen3_moe.model.layers[0].mlp.gate
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with trainer_mode.enable(device="cpu") as mode:
        mode.route_moe_routers(qwen3_moe)
        _, weights, _ = gate(hidden)
        weights.float().square().sum().backward()
    assert gate.weight.grad is not None and bool(gate.weight.grad.abs().sum() > 0)
    gate.weight.grad = None
