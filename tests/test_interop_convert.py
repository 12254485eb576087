"""Checkpoint conversion trainer <-> engine: containers change, bits never do; the in-process handoff."""

from __future__ import annotations

import pickle

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from interop import trainer_mode
from interop.convert import (load_state_dict_file, loaded_from_torch_model, save_state_dict_file,
                             state_dict_to_weights, update_runner_weights, weights_to_state_dict)
from interop.testing import make_tiny_hf_model
from jengine.engine.batch import StepBatch
from jengine.profiles import override_profile
from tests.bits import count_bit_differences

IDS = np.random.default_rng(0).integers(0, 32768, 24)


def test_state_dict_round_trip_is_bit_exact_and_zero_copy():
    sd = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.randn(7), "c": torch.arange(4)}
    w = state_dict_to_weights(sd)
    assert str(w["a"].dtype) == "bfloat16" and w["b"].dtype == np.float32
    assert np.shares_memory(w["b"], sd["b"].numpy())  # CPU tensors are shared, not copied
    back = weights_to_state_dict(w)
    for k in sd:
        assert back[k].dtype == sd[k].dtype
        assert torch.equal(back[k].view(torch.uint8), sd[k].view(torch.uint8))
    with pytest.raises(TypeError, match="state_dict\\['x'\\]"):
        state_dict_to_weights({"x": [1, 2]})


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_state_dict_files(tmp_path, suffix):
    sd = {"w": torch.randn(4, 4).to(torch.bfloat16), "v": torch.randn(4)}
    save_state_dict_file(sd, tmp_path / f"m{suffix}")
    back = load_state_dict_file(tmp_path / f"m{suffix}")
    assert all(torch.equal(back[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in sd)


def test_pt_files_never_unpickle_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"w": Evil()}, f)
    with pytest.raises(Exception, match="Weights only load failed|weights_only"):
        load_state_dict_file(tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="unknown checkpoint suffix"):
        load_state_dict_file(tmp_path / "m.ckpt")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from interop.trainer_dump import load_hf_model
    from jengine.config import LaunchConfig
    from jengine.numerics import resolve_launch

    d = make_tiny_hf_model(tmp_path_factory.mktemp("convert") / "m", "Qwen2ForCausalLM", seed=7)
    resolved = resolve_launch(LaunchConfig(numerics="rl-bitwise"))
    resolved.apply_environment()
    return load_hf_model(d), resolved


def _runner(loaded, resolved):
    from jengine.engine.model_runner import ModelRunner

    from jengine.launch import plan_launch

    with override_profile(loaded.config.architecture, numerics_envelopes={"rl-bitwise"}):
        plan = plan_launch(resolved, loaded.config)
    return ModelRunner(loaded.config, loaded.checkpoint, plan.runner)


def _engine_logits(runner):
    t = len(IDS)
    pages = -(-t // runner.page_size)
    batch = StepBatch(input_ids=IDS, positions=np.arange(t), token_req=np.zeros(t),
                      block_tables=np.arange(1, pages + 1)[None], hidden_rows=np.arange(t))
    return np.asarray(runner.compute_logits(runner.forward(batch)))


def _hf_logits(model):
    with trainer_mode.enable(model), torch.no_grad():
        logits = model(torch.tensor(IDS)[None], use_cache=False).logits[0]
    return logits.float().numpy()


def test_in_process_handoff_after_a_training_step(setup):
    """Trainer weights -> engine without disk; after a (fake) optimizer step the handoff updates the
    live runner, and the engine's logits track the trainer's forward bit for bit."""
    model, resolved = setup
    runner = _runner(loaded_from_torch_model(model), resolved)
    before = _engine_logits(runner)
    assert count_bit_differences(_hf_logits(model), before) == 0

    with torch.no_grad():  # the "training step"
        for p in model.parameters():
            p.add_(torch.randn_like(p.float()).to(p.dtype) * 0.01)
    stale = _engine_logits(runner)
    trainer_now = _hf_logits(model)
    assert count_bit_differences(trainer_now, stale) > 0  # negative control: old weights differ

    update_runner_weights(runner, model.state_dict())
    assert count_bit_differences(trainer_now, _engine_logits(runner)) == 0

    wrong = dict(model.state_dict())
    wrong["model.norm.weight"] = wrong["model.norm.weight"][:-1]
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(63,\) but the model "
                                         r"expects \(64,\)"):
        update_runner_weights(runner, wrong)


def test_engine_weights_back_into_torch(setup):
    model, _ = setup
    reference = _hf_logits(model)
    weights = state_dict_to_weights(model.state_dict())
    clone = type(model)(model.config).to(torch.bfloat16).eval()
    clone.load_state_dict(weights_to_state_dict(weights))
    assert count_bit_differences(_hf_logits(clone), reference) == 0
    assert np.asarray(jnp.asarray(weights["model.norm.weight"])).dtype == weights["model.norm.weight"].dtype
