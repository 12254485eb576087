"""Gradients under trainer mode: ``loss.backward()`` through HF's own forward, routed to the twins.

The forward stays bitwise (the engine's logprobs, compared by their bits); the backward is accurate
torch arithmetic, so gradients are compared with stock torch's by a relative norm per tensor,
||g_trainer_mode - g_stock|| / ||g_stock||, never by bits. The tolerances are set from measurements
(jax 0.10.2, torch 2.13, transformers 5.24, CPU; tiny Qwen3, 24 tokens, seed 3):

* bf16 model: every parameter 0.9e-2 .. 2.0e-2 (Qwen2 and Llama: at most 2.8e-2 and 1.8e-2). The two
  forwards round differently (fixed-order GEMM and XLA's functions vs MKL and torch's), and a bf16
  activation's rounding moves the gradient by ~2^-8 relative per op; BF16_TOLERANCE = 6e-2.
* f32 model: every parameter 0.5e-6 .. 4.2e-6 (Qwen2: at most 6.4e-6); F32_TOLERANCE = 1e-4, which a
  backward off by 1 % (the negative control) exceeds a hundredfold.
* single ops, f32: below 1e-6; OP_TOLERANCE = 2e-6.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from interop import trainer_mode, twin_autograd
from interop.align import teacher_force
from interop.convert import update_runner_weights
from interop.testing import make_tiny_hf_model
from interop.trainer_dump import load_hf_model
from interop.trainer_logprobs import token_logprobs
from jengine.engine.engine import Engine
from jengine.profiles import override_profile
from tests.bits import count_bit_differences

ARCH = "Qwen3ForCausalLM"  # q/k norms: every routed op of the model path has a gradient to carry
BF16_TOLERANCE = 6e-2
F32_TOLERANCE = 1e-4
OP_TOLERANCE = 2e-6
IDS = torch.tensor(np.random.default_rng(0).integers(0, 32768, 24))


def _relative_errors(got: dict, want: dict) -> dict[str, float]:
    return {n: float((got[n].float() - want[n].float()).norm() / want[n].float().norm()) for n in want}


def _stock_logprobs(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]


def _logprobs_and_grads(model, under_trainer_mode: bool):
    """The trainer's loss (sum of the sequence's logprobs), backward; (logprobs, {name: grad})."""
    model.zero_grad(set_to_none=True)
    if under_trainer_mode:
        with trainer_mode.enable(model) as mode:
            logits = model(IDS[None], use_cache=False).logits[0]
            logprobs = token_logprobs(logits[:-1], IDS[1:])
            logprobs.sum().backward()
        assert not mode.fallbacks, mode.summary()
    else:
        logits = model(IDS[None], use_cache=False).logits[0]
        logprobs = _stock_logprobs(logits[:-1], IDS[1:])
        logprobs.sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient reached {missing}"
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("grad") / ARCH, ARCH, seed=3)


@pytest.fixture(scope="module")
def engine(model_dir):
    with override_profile(ARCH, numerics_envelopes={"rl-bitwise"}):
        eng = Engine(model_path=str(model_dir), numerics="rl-bitwise", skip_warmup=True,
                     max_total_tokens=4096, chunked_prefill_size=64, max_prefill_tokens=128)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def bf16_run(model_dir):
    model = load_hf_model(model_dir).train()
    _, stock = _logprobs_and_grads(model, False)
    logprobs, grads = _logprobs_and_grads(model, True)
    return logprobs, grads, stock


def test_bf16_gradients_match_stock_torch_and_logprobs_match_the_engine(bf16_run, engine):
    logprobs, grads, stock = bf16_run
    errors = _relative_errors(grads, stock)
    assert max(errors.values()) <= BF16_TOLERANCE, errors
    # The forward that was differentiated is still the engine's, bit for bit.
    (engine_logprobs,) = teacher_force(engine, [IDS.tolist()], packed=False)
    assert logprobs.dtype == torch.float32
    assert count_bit_differences(logprobs.numpy(), engine_logprobs) == 0


def test_f32_gradients_match_stock_torch_and_a_wrong_backward_does_not(model_dir, monkeypatch):
    model = load_hf_model(model_dir).float().train()
    _, stock = _logprobs_and_grads(model, False)
    _, grads = _logprobs_and_grads(model, True)
    errors = _relative_errors(grads, stock)
    assert max(errors.values()) <= F32_TOLERANCE, errors

    # Negative control: an attention backward off by 1 % is caught in every attention weight.
    exact = twin_autograd.causal_attention_backward
    monkeypatch.setattr(twin_autograd, "causal_attention_backward",
                        lambda *a: tuple(g * 1.01 for g in exact(*a)))
    _, wrong = _logprobs_and_grads(model, True)
    wrong_errors = _relative_errors(wrong, stock)
    assert all(wrong_errors[n] > 10 * F32_TOLERANCE for n in wrong_errors if "_proj" in n
               and ".self_attn." in n and "o_proj" not in n), wrong_errors


def test_sgd_step_under_trainer_mode_then_the_engine_scores_the_new_weights(model_dir, engine):
    model = load_hf_model(model_dir).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    old_logprobs, _ = _logprobs_and_grads(model, True)
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(changed) == len(before), set(before) - set(changed)

    update_runner_weights(engine.runner, model.state_dict())  # state_dict_to_weights, no disk
    assert engine.flush_cache()
    new_logprobs, _ = _logprobs_and_grads(model, True)  # the next step's forward, grad enabled
    (engine_logprobs,) = teacher_force(engine, [IDS.tolist()], packed=False)
    assert count_bit_differences(new_logprobs.numpy(), engine_logprobs) == 0
    assert count_bit_differences(new_logprobs.numpy(), old_logprobs.numpy()) > 0


# -- single ops: each routed op's gradient, under trainer mode vs stock torch (f32) ----------------


def _attention(q, k, v):
    """Stock causal attention in the twin's layout: q [B, S, Hq, D], k/v [B, S, Hkv, D]."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, scale=0.25)
    return out.transpose(1, 2)


def _op_cases():
    """(name, stock torch function, trainer-mode function, input shapes, positive inputs?, the aten
    op trainer mode routes or None for a twin called above the dispatcher)."""
    positive = {"rsqrt", "log", "pow.Tensor_Scalar", "pow.Tensor_Tensor"}

    def twin_attention(q, k, v):
        return twin_autograd.twin_attention(trainer_mode.active().table.attention, q, k, v,
                                            scale=0.25)

    def trainer_logprobs(logits):
        return token_logprobs(logits, torch.arange(logits.shape[0]) * 7, block_size=16384)

    same = [
        ("mm", lambda a, b: a @ b, [(5, 24), (24, 7)]),
        ("addmm", lambda c, a, b: torch.addmm(c, a, b), [(7,), (5, 24), (24, 7)]),
        ("bmm", torch.bmm, [(3, 5, 8), (3, 8, 4)]),
        ("mean.dim", lambda x: x.mean(-1, keepdim=True), [(6, 48)]),
        ("rsqrt", torch.rsqrt, [(300,)]),
        ("silu", F.silu, [(300,)]),
        ("cos", torch.cos, [(300,)]),
        ("sin", torch.sin, [(300,)]),
        ("exp", torch.exp, [(300,)]),
        ("log", torch.log, [(300,)]),
        ("pow.Tensor_Scalar", lambda x: x.pow(0.37), [(300,)]),
        ("pow.Scalar", lambda x: 2.0 ** x, [(300,)]),
        ("pow.Tensor_Tensor", lambda x, y: x.pow(y), [(300,), (300,)]),
    ]
    cases = [(name, fn, fn, shapes, name in positive, name) for name, fn, shapes in same]
    cases.append(("attention", _attention, twin_attention,
                  [(2, 19, 4, 8), (2, 19, 2, 8), (2, 19, 2, 8)], False, None))
    cases.append(("blockwise logprob", lambda x: _stock_logprobs(x, torch.arange(x.shape[0]) * 7),
                  trainer_logprobs, [(5, 20000)], False, None))
    return cases


@pytest.mark.parametrize("name,stock_fn,trainer_fn,shapes,positive,aten_op", _op_cases(),
                         ids=[c[0] for c in _op_cases()])
def test_each_routed_op_has_an_accurate_gradient(name, stock_fn, trainer_fn, shapes, positive,
                                                 aten_op):
    rng = np.random.default_rng(len(name))
    inputs = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    if positive:
        inputs = [x.abs() + 0.1 for x in inputs]
    inputs = [x.requires_grad_() for x in inputs]
    stock_out = stock_fn(*inputs)
    cotangent = torch.from_numpy(rng.standard_normal(tuple(stock_out.shape)).astype(np.float32))
    want = torch.autograd.grad(stock_out, inputs, cotangent)
    with trainer_mode.enable() as mode:
        out = trainer_fn(*inputs)
        got = torch.autograd.grad(out, inputs, cotangent)
    assert not mode.fallbacks, mode.summary()
    assert aten_op is None or mode.routed[aten_op], mode.summary()  # the twin ran, not torch
    errors = _relative_errors(dict(enumerate(got)), dict(enumerate(want)))
    assert max(errors.values()) <= OP_TOLERANCE, (name, errors)
