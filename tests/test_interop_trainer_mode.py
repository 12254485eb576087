"""Trainer mode: torch ops routed to the engine's leaf twins, op by op and through HF's own forward.

Every claim is bitwise (tests/bits.py), each with a negative control: stock torch differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from interop import trainer_mode
from interop.bisect import engine_states
from interop.convert import numpy_to_tensor, tensor_to_numpy
from interop.states import capture_hf_states, state_names
from interop.testing import make_tiny_hf_model
from interop.twins import TwinError, plan_twin_table
from jengine.profiles import override_profile
from pallas_kernels import activation, gemm, moe_router, rmsnorm
from pallas_kernels.registry import REGISTRY, Priority, register
from tests.bits import count_bit_differences

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _bf16(rng, shape, scale=1.0):
    return numpy_to_tensor((rng.standard_normal(shape) * scale).astype(np.float32)
                           .astype(ml_dtypes.bfloat16))


def _f32(rng, shape, positive=False):
    a = rng.standard_normal(shape).astype(np.float32) * 4
    return torch.from_numpy(np.abs(a) + np.float32(1e-3) if positive else a)


def _diff(t, x) -> int:
    return count_bit_differences(tensor_to_numpy(t), np.asarray(x))


def _j(t):
    return jnp.asarray(tensor_to_numpy(t))


@pytest.fixture(scope="module")
def op_cases():
    """(name, torch call, engine result) for every routed op."""
    rng = np.random.default_rng(0)
    x, w, b = _bf16(rng, (7, 64)), _bf16(rng, (64, 96), 0.125), _bf16(rng, (96,))
    xb, wb = _bf16(rng, (3, 7, 16)), _bf16(rng, (3, 16, 5))
    h = _f32(rng, (9, 256))
    u, p = _f32(rng, (1 << 16,)), _f32(rng, (1 << 16,), positive=True)
    g = _bf16(rng, (4096,), 4.0)
    e = torch.arange(0, 64, 2, dtype=torch.float32) / 64
    bf = jnp.bfloat16
    return [
        ("mm", lambda: x @ w, gemm.gemm_fixed_order(_j(x), _j(w), out_dtype=bf)),
        ("addmm", lambda: torch.addmm(b, x, w), gemm.gemm_fixed_order(_j(x), _j(w), _j(b), out_dtype=bf)),
        ("linear+bias 3-D", lambda: F.linear(x[None], w.t(), b)[0],
         gemm.gemm_fixed_order(_j(x), _j(w), _j(b), out_dtype=bf)),
        ("bmm", lambda: torch.bmm(xb, wb),
         jnp.stack([gemm.gemm_fixed_order(_j(xb[i]), _j(wb[i]), out_dtype=bf) for i in range(3)])),
        ("mean.dim", lambda: h.pow(2).mean(-1, keepdim=True), rmsnorm.mean_fixed_order(_j(h) * _j(h))),
        ("rsqrt", lambda: torch.rsqrt(p), jax.lax.rsqrt(_j(p))),
        ("silu f32", lambda: F.silu(u), activation.silu(_j(u))),
        ("silu bf16", lambda: F.silu(g), activation.silu(_j(g))),
        ("cos", lambda: u.cos(), jnp.cos(_j(u))),
        ("sin", lambda: u.sin(), jnp.sin(_j(u))),
        ("exp", lambda: u.exp(), jnp.exp(_j(u))),
        ("log", lambda: p.log(), jnp.log(_j(p))),
        # 1-D arrays of 3, 5, 6, 7, 11, 13-15 elements take another XLA:CPU code path for exp/log;
        # the twins pad, so short tensors still get the bulk bits the engine computes.
        ("exp short", lambda: torch.cat([u[i:i + 5].exp() for i in range(0, 75, 5)]), jnp.exp(_j(u))[:75]),
        ("log short", lambda: torch.cat([p[i:i + 7].log() for i in range(0, 77, 7)]), jnp.log(_j(p))[:77]),
        ("pow(x, 0.37)", lambda: p.pow(0.37), jnp.power(_j(p), 0.37)),
        ("pow(theta, e)", lambda: 10000.0 ** e, jnp.float32(10000.0) ** _j(e)),
    ]


def test_routed_ops_reproduce_the_engine_bitwise(op_cases):
    with trainer_mode.enable() as mode:
        results = {name: _diff(call(), engine) for name, call, engine in op_cases}
    assert results == {name: 0 for name in results}, results
    assert not mode.fallbacks, mode.summary()
    assert {"mm", "addmm", "bmm", "mean.dim", "rsqrt", "silu", "cos", "sin", "exp", "log",
            "pow.Tensor_Scalar", "pow.Scalar"} <= set(mode.routed)


def test_negative_control_stock_torch_differs(op_cases):
    """Without trainer mode the transcendental ops differ from XLA's on the CPU: the check can fail."""
    stock = {name: _diff(call(), engine) for name, call, engine in op_cases}
    for name in ("rsqrt", "exp", "log", "cos", "sin", "silu f32", "pow(x, 0.37)"):
        assert stock[name] > 0, (name, stock)


def test_disable_restores_torch_and_counts_fallbacks():
    rng = np.random.default_rng(1)
    p = _f32(rng, (4096,), positive=True)
    x, w, b = _bf16(rng, (4, 32)), _bf16(rng, (32, 8)), _bf16(rng, (8,))
    stock_rsqrt, stock_addmm = torch.rsqrt(p), torch.addmm(b, x, w, beta=0.5)
    with trainer_mode.enable() as mode:
        routed = torch.rsqrt(p)
        odd = torch.addmm(b, x, w, beta=0.5)  # not a form the GEMM leaf covers: torch's own kernel
        with pytest.raises(RuntimeError, match="already enabled"):
            trainer_mode.enable()
    assert mode.fallbacks["addmm"] == 1 and _diff(odd, tensor_to_numpy(stock_addmm)) == 0
    assert _diff(routed, tensor_to_numpy(stock_rsqrt)) > 0  # the mode changed something ...
    assert _diff(torch.rsqrt(p), tensor_to_numpy(stock_rsqrt)) == 0  # ... and disable undid it
    assert trainer_mode.active() is None
    trainer_mode.disable()  # idempotent


def test_twin_table_comes_from_the_planned_leaves():
    table = plan_twin_table("cpu")
    assert "fixed_order" in table.provenance["gemm"] and "fixed_tree" in table.provenance["block_sumexp"]
    assert table.gemm is gemm.gemm_fixed_order_torch and table.silu is activation.silu_torch
    assert table.router_topk is moe_router.router_topk_torch_torch  # --router-topk torch's leaf

    def twinless_silu(x, *, times=None):
        return x

    register("activation", "silu", "test_twinless", formats={"bf16", "f32"}, hardware={"any"},
             priority=Priority.VENDOR, traits={"batch_invariant": True},
             features={"batch_invariant"})(twinless_silu)
    plan_twin_table.cache_clear()
    try:
        with pytest.raises(TwinError, match="test_twinless"):
            plan_twin_table("cpu")
    finally:
        REGISTRY.unregister("activation", "silu", "test_twinless")
        plan_twin_table.cache_clear()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {a: make_tiny_hf_model(root / a, a, seed=i) for i, a in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def resolved():
    from jengine.config import LaunchConfig
    from jengine.numerics import resolve_launch

    r = resolve_launch(LaunchConfig(numerics="rl-bitwise"))
    r.apply_environment()
    return r


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_forward_under_trainer_mode_matches_engine_states(hf_dirs, resolved, arch):
    """Every named state (interop/states.py) and the logits of HF's own forward equal the engine's."""
    from interop.trainer_dump import load_hf_model
    from jengine.engine.model_runner import ModelRunner
    from jengine.launch import plan_launch
    from jengine.models import load_model

    ids = np.random.default_rng(2).integers(0, 32768, 40)
    model = load_hf_model(hf_dirs[arch])
    inv_freq = model.model.rotary_emb.inv_freq.clone()

    def hf_forward():
        with torch.no_grad(), capture_hf_states(model, len(ids)) as states:
            logits = model(torch.tensor(ids)[None], use_cache=False).logits[0]
        return dict(states), tensor_to_numpy(logits)

    stock_states, stock_logits = hf_forward()
    with trainer_mode.enable(model):
        assert model.config._attn_implementation == trainer_mode.ATTENTION_NAME
        states, logits = hf_forward()
    assert model.config._attn_implementation != trainer_mode.ATTENTION_NAME  # restored
    assert torch.equal(model.model.rotary_emb.inv_freq.view(torch.int32), inv_freq.view(torch.int32))

    loaded = load_model(str(hf_dirs[arch]), progress=False)
    with override_profile(arch, numerics_envelopes={"rl-bitwise"}):
        plan = plan_launch(resolved, loaded.config)
    runner = ModelRunner(loaded.config, loaded.checkpoint, plan.runner)
    engine, replay_agrees = engine_states(runner, ids)
    assert replay_agrees, "interop/bisect.py's replay no longer mirrors the model's forward"
    engine_logits = np.asarray(runner.compute_logits(jnp.asarray(engine["norm"])))
    names = state_names(runner.model_config.num_hidden_layers, runner.model_config.qk_norm)
    assert set(names) == set(states)
    diffs = {n: count_bit_differences(states[n], engine[n]) for n in names}
    assert diffs == {n: 0 for n in names}, {n: d for n, d in diffs.items() if d}
    assert count_bit_differences(logits.astype(np.float32), engine_logits) == 0
    # Negative control: HF's stock forward (MKL GEMMs, SDPA, torch's transcendental functions).
    assert count_bit_differences(stock_logits.astype(np.float32), engine_logits) > 0
    assert any(count_bit_differences(stock_states[n], engine[n]) for n in names)


def test_twin_attention_refuses_padding(hf_dirs):
    from interop.trainer_dump import load_hf_model

    model = load_hf_model(hf_dirs["Qwen3ForCausalLM"])
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with trainer_mode.enable(model), torch.no_grad():
        with pytest.raises(ValueError, match="unpadded causal"):
            model(ids, attention_mask=mask, use_cache=False)
        model(ids, use_cache=False)  # an unpadded batch is fine
