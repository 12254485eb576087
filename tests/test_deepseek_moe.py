"""`DeepseekMoE` (jengine/models/layers/deepseek_moe.py) against HF transformers' `DeepseekV3MoE` on
the same random weights: within a stated tolerance in auto, bit for bit under trainer mode (HF's
router and experts routed to the engine's leaves, interop/trainer_moe.py), and stock torch differs.
LongCat-Flash's zero experts: an identity slot is x * weight in the slot-order fold, exported as -1.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from interop import trainer_mode
from interop.convert import tensor_to_numpy
from jengine.models.family import MoEOptions
from jengine.models.layers.deepseek_moe import DeepseekMoE, ModelKernels
from jengine.models.layers.param import CheckpointSource, MappingReader, ParamSpec, RandomSource
from jengine.models.qwen3_moe import checkpoint_name
from tests.bits import count_bit_differences

E, K, H, I, SHARED = 16, 4, 32, 16, 2


def _hf_config():
    import transformers

    return transformers.DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
        n_group=4, topk_group=2, n_shared_experts=SHARED, norm_topk_prob=True,
        routed_scaling_factor=2.5, hidden_act="silu")


def _cfg(**overrides):
    """The config fields DeepseekMoE reads (what the DeepSeek-V3 family's ModelConfig carries)."""
    fields = dict(hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                  norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  n_shared_experts=SHARED, zero_expert_num=0, router_score="sigmoid",
                  router_in_fp32=True)
    return SimpleNamespace(**{**fields, **overrides})


def _named(tree, prefix="model.layers.0.mlp."):
    """The layer's specs named as the family names them (qwen3_moe.checkpoint_name's experts)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, ParamSpec):
            path = prefix + key
            out[key] = value.named(checkpoint_name(None, path[len("model."):])
                                   if value.stacked else path)
        else:
            out[key] = _named(value, f"{prefix}{key}.")
    return out


@pytest.fixture(scope="module")
def hf_moe():
    """A tiny HF DeepseekV3MoE in bf16 (router f32, as HF keeps it), random weights and bias."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(0)
    moe = DeepseekV3MoE(_hf_config())
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.gate.e_score_correction_bias.normal_(0, 0.05)
    moe = moe.to(torch.bfloat16).eval()
    moe.gate.float()  # HF's _keep_in_fp32_modules_strict: gate.weight and the bias stay f32
    return moe


def _checkpoint(moe):
    """HF's per-expert checkpoint names -> arrays (the fused [E, 2I, H] gate_up split back)."""
    t = {f"model.layers.0.mlp.{n}": tensor_to_numpy(p.detach())
         for n, p in moe.named_parameters() if not n.startswith("experts.")}
    t["model.layers.0.mlp.gate.e_score_correction_bias"] = tensor_to_numpy(
        moe.gate.e_score_correction_bias)
    for e in range(E):
        gate_up, down = moe.experts.gate_up_proj[e].detach(), moe.experts.down_proj[e].detach()
        for name, value in (("gate_proj", gate_up[:I]), ("up_proj", gate_up[I:]),
                            ("down_proj", down)):
            t[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = tensor_to_numpy(value)
    return t


def _kernels(dtype, features, router_topk):
    return ModelKernels.plan_for(dtype=dtype, hardware="cpu", features=frozenset(features),
                                 moe=MoEOptions(router_topk=router_topk, combine_order="slot"))


def _layer(moe, dtype, cfg=None):
    cfg = cfg or _cfg()
    specs = _named(DeepseekMoE.specs(cfg, dtype=dtype))
    return DeepseekMoE(cfg, specs, CheckpointSource(MappingReader(_checkpoint(moe))))


def _x(rows=24, seed=1):
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _engine(layer, kernels, x):
    out, ids = jax.jit(lambda v: layer.routed(kernels, v, dtype=jnp.bfloat16))(
        jnp.asarray(tensor_to_numpy(x)))
    return np.asarray(out), np.asarray(ids)


def test_specs_name_hf_checkpoint_tensors(hf_moe):
    names = {s.checkpoint for s in jax.tree.leaves(_named(DeepseekMoE.specs(_cfg(), dtype=jnp.bfloat16)))}
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.gate.e_score_correction_bias",
            "model.layers.0.mlp.experts.{}.gate_proj.weight",
            "model.layers.0.mlp.shared_experts.down_proj.weight"} <= names
    specs = DeepseekMoE.specs(_cfg(), dtype=jnp.bfloat16)
    assert specs["gate"]["weight"].dtype == jnp.float32
    assert specs["experts"]["gate_proj"].axes == ("expert", "embed", "expert_mlp")
    assert specs["shared_experts"]["gate_proj"]["weight"].shape == (H, SHARED * I)


def test_trainer_mode_matches_bitwise_and_stock_torch_differs(hf_moe):
    layer = _layer(hf_moe, jnp.bfloat16)
    x = _x()
    got, ids = _engine(layer, _kernels(jnp.bfloat16, {"batch_invariant"}, "torch"), x)
    with torch.no_grad():
        stock = tensor_to_numpy(hf_moe(x[None])[0])
    with trainer_mode.enable(device="cpu") as mode:
        assert mode.route_moe_routers(hf_moe) == 1 and mode.route_moe_experts(hf_moe) == 1
        with torch.no_grad():
            trainer = tensor_to_numpy(hf_moe(x[None])[0])
            _, _, hf_ids = hf_moe.gate(x)
        assert mode.routed["router_grouped_topk"] == 2 and mode.routed["moe_experts"] == 1
    assert "forward" not in vars(hf_moe.gate) and "forward" not in vars(hf_moe.experts)
    assert (tensor_to_numpy(hf_ids) == ids).all()
    assert count_bit_differences(got, trainer) == 0
    assert count_bit_differences(got, stock) > 0  # HF's rounding points and combine order


def test_auto_within_tolerance_of_stock_hf(hf_moe):
    """auto (stable router, portable experts) vs stock HF, both bf16: the same experts on these
    rows, outputs within 2 bf16 ulps of the output scale -- the rounding points (weight after
    down_proj, expert-id order bf16 adds in HF) differ by design."""
    layer = _layer(hf_moe, jnp.bfloat16)
    x = _x(seed=3)
    got, ids = _engine(layer, _kernels(jnp.bfloat16, set(), "auto"), x)
    with torch.no_grad():
        stock = tensor_to_numpy(hf_moe(x[None])[0]).astype(np.float32)
        _, _, hf_ids = hf_moe.gate(x)
    assert (np.sort(tensor_to_numpy(hf_ids), -1) == np.sort(ids, -1)).all()
    err = np.abs(got.astype(np.float32) - stock).max()
    assert err <= 2 * 2.0 ** -7 * np.abs(stock).max(), err


def test_trainer_mode_router_has_a_gradient(hf_moe):
    x = _x(rows=6, seed=4)
    with trainer_mode.enable(device="cpu") as mode:
        mode.route_moe_routers(hf_moe)
        _, weights, _ = hf_moe.gate(x)
        weights.square().sum().backward()
    grad = hf_moe.gate.weight.grad
    assert grad is not None and bool(grad.abs().sum() > 0) and bool(torch.isfinite(grad).all())
    hf_moe.gate.weight.grad = None


def test_zero_experts_fold_identity_in_slot_order():
    """LongCat-Flash's form: softmax router over 8 real + 4 zero experts, no groups, no norm.
    A zero-expert slot contributes x * weight (rounded to bf16) in its slot of the f32 fold and is
    exported as -1; the same routing with those slots dropped (the control) differs."""
    cfg = _cfg(num_experts=8, zero_expert_num=4, n_group=1, topk_group=1, n_shared_experts=0,
               norm_topk_prob=False, router_score="softmax", routed_scaling_factor=6.0,
               num_experts_per_tok=4)
    specs = DeepseekMoE.specs(cfg, dtype=jnp.bfloat16)
    assert "shared_experts" not in specs and specs["gate"]["weight"].shape == (H, 12)
    layer = DeepseekMoE(cfg, specs, RandomSource(0))
    # Lift two zero experts so every token picks them next to two real experts.
    layer.gate.e_score_correction_bias[...] = jnp.zeros((12,), jnp.float32).at[8:10].set(1.0)
    kernels = _kernels(jnp.bfloat16, {"batch_invariant"}, "torch")
    x = jax.random.normal(jax.random.key(2), (10, H)).astype(jnp.bfloat16)
    out, ids = jax.jit(lambda v: layer.routed(kernels, v, dtype=jnp.bfloat16))(x)
    raw_ids, weights = layer.route(kernels, x, dtype=jnp.bfloat16)
    ids, raw_ids = np.asarray(ids), np.asarray(raw_ids)
    zero = raw_ids >= 8
    assert zero.any() and (~zero).any()
    assert (ids == np.where(zero, -1, raw_ids)).all()
    terms = []
    for s in range(cfg.num_experts_per_tok):  # each slot's term, the engine's own expert path
        e = np.where(zero[:, s], 0, raw_ids[:, s])
        w = jnp.where(jnp.asarray(zero[:, s]), 0, weights[:, s])
        routed = jnp.stack([_one_expert(layer, kernels, x[t], int(e[t]), w[t])
                            for t in range(x.shape[0])])
        residual = (x * weights[:, s, None]).astype(jnp.bfloat16)
        terms.append(jnp.where(jnp.asarray(zero[:, s])[:, None], residual, routed))
    fold = terms[0].astype(jnp.float32)
    for term in terms[1:]:
        fold = fold + term.astype(jnp.float32)
    assert count_bit_differences(out, fold.astype(jnp.bfloat16)) == 0
    dropped = sum(jnp.where(jnp.asarray(zero[:, s])[:, None], 0, terms[s]).astype(jnp.float32)
                  for s in range(len(terms)))
    assert count_bit_differences(out, dropped.astype(jnp.bfloat16)) > 0


def _one_expert(layer, kernels, xt, e, w):
    gate, up, down = (getattr(layer.experts, n)[...] for n in ("gate_proj", "up_proj", "down_proj"))
    xt = xt[None]
    a = (kernels.silu(kernels.gemm(xt, gate[e], None, out_dtype=jnp.bfloat16))
         * kernels.gemm(xt, up[e], None, out_dtype=jnp.bfloat16))
    return kernels.gemm(a * w, down[e], None, out_dtype=jnp.bfloat16)[0]


def test_refuses_unknown_router_score():
    with pytest.raises(ValueError, match="router_score='relu'"):
        DeepseekMoE(_cfg(router_score="relu"), DeepseekMoE.specs(_cfg(), dtype=jnp.float32),
                    RandomSource(0))


def test_kernel_set_plans_the_grouped_router():
    kernels = _kernels(jnp.bfloat16, {"batch_invariant"}, "torch")
    assert kernels.router_grouped_topk.leaf.impl == "torch"
    assert "f32" in kernels.router_gemm.leaf.formats
    assert dataclasses.is_dataclass(kernels)
