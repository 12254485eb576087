"""Qwen3-MoE's experts in transformers 5's fused layout (jengine/models/fused_experts.py): what a
5.x trainer's `named_parameters()` pushes into a running engine, in one call or in buckets, and a
checkpoint saved from its `state_dict()` as is, serve the bits of a fresh engine loaded from the
`save_pretrained` directory (one tensor per expert): greedy ids and logprob bits, and every
parameter's bits (what the outputs are a function of; cheaper to compare than more requests).
Refusals name the tensor: a shape other than the layout's, a layer named in both layouts. Negative
control: W0 and W1 serve different bits, so the equalities can fail.

W0 and W1: the session's tiny random Qwen3-MoE checkpoints (tests/conftest.py). Two engines: a
fresh one on W1, and one launched on W0 that every test updates.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jengine import Engine  # noqa: E402
from jengine.engine.request import InvalidRequest  # noqa: E402
from jengine.models import load_model  # noqa: E402
from jengine.models.loader import SafetensorsCheckpoint  # noqa: E402
from tests.bits import count_bit_differences  # noqa: E402
from tests.test_orbax import record  # noqa: E402
from tests.test_weight_update import LAUNCH, compiled  # noqa: E402

FUSED = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def hf(moe_ckpts):
    """W0 and W1 as transformers 5 holds them (the experts fused)."""
    return {w: transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
            for w, path in moe_ckpts.items()}


@pytest.fixture(scope="module")
def fused_dir(moe_ckpts, hf, tmp_path_factory):
    """W1's model directory with its weights saved from `state_dict()` as is (the fused layout)."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("fused") / "w1"
    shutil.copytree(moe_ckpts["w1"], out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({n: t.contiguous() for n, t in hf["w1"].state_dict().items()},
              str(out / "model.safetensors"))
    return out


def params(eng) -> list:
    """The served parameter tuple, copied to the host."""
    return [np.asarray(p) for p in eng.runner._params]


def differing(a: list, b: list) -> int:
    """How many parameters differ in any bit."""
    return sum(count_bit_differences(x, y) > 0 for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def fresh(moe_ckpts):
    """What a fresh engine started from W1's save_pretrained directory serves, and its weights."""
    with Engine(model_path=str(moe_ckpts["w1"]), **LAUNCH) as eng:
        return record(eng), params(eng)


@pytest.fixture(scope="module")
def eng(moe_ckpts):
    with Engine(model_path=str(moe_ckpts["w0"]), **LAUNCH) as engine:
        engine.w0 = record(engine), params(engine)
        yield engine


def test_a_fused_checkpoint_reads_as_the_per_expert_tensors(moe_ckpts, fused_dir):
    """Every per-expert tensor, read from the fused file, has the save_pretrained file's bits."""
    assert FUSED in SafetensorsCheckpoint(fused_dir).names()
    fused, split = (load_model(str(p), progress=False).checkpoint
                    for p in (fused_dir, moe_ckpts["w1"]))
    assert sorted(fused.names()) == sorted(split.names())
    for name in split.names():
        assert (fused.shape(name), fused.dtype(name)) == (split.shape(name), split.dtype(name))
        assert count_bit_differences(fused.read(name), split.read(name)) == 0, name


def test_update_from_transformers5_named_parameters(eng, hf, fresh):
    """Ids and logprob bits, and every parameter bit, of the fresh W1 engine."""
    named = list(hf["w1"].named_parameters())
    assert FUSED in dict(named)
    assert eng.w0[0] != fresh[0] and differing(eng.w0[1], fresh[1]) > 0  # the control
    before = compiled(eng)
    eng.update_weights_from_tensor(named, weight_version="w1")
    assert record(eng) == fresh[0]
    assert differing(params(eng), fresh[1]) == 0
    assert compiled(eng) == before, "a weight update compiled a step program again"


def test_fused_buckets_and_a_fused_directory(eng, hf, fused_dir, fresh):
    """W0 in buckets of 5 (a layer's gate_up_proj and down_proj may arrive in different
    buckets), then an update from disk of W1's fused directory: the parameter bits each serves."""
    named = list(hf["w0"].named_parameters())
    for i in range(0, len(named), 5):
        eng.update_weights_from_tensor(named[i:i + 5])
    assert differing(params(eng), eng.w0[1]) == 0
    eng.update_weights_from_disk(str(fused_dir))
    assert differing(params(eng), fresh[1]) == 0


def test_a_wrong_shape_or_a_mixed_layer_is_refused_naming_the_tensor(eng, hf):
    eng.update_weights_from_tensor(list(hf["w0"].named_parameters()))
    named = dict(hf["w1"].named_parameters())
    down = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(InvalidRequest, match=rf"^named_tensors tensor '{down}' has shape "
                       r"\(8, 32, 64\), but transformers' fused layout is \[num_experts, "
                       r"hidden_size, moe_intermediate_size\] = \(8, 64, 32\)$"):
        eng.update_weights_from_tensor({down: named[down].transpose(1, 2)})
    expert = "model.layers.0.mlp.experts.3.down_proj.weight"
    with pytest.raises(InvalidRequest, match=rf"^named_tensors tensor '{FUSED}' and the "
                       rf"per-expert tensor '{expert}' both name the experts of "
                       r"'model\.layers\.0\.mlp\.experts': send one layout per layer"):
        eng.update_weights_from_tensor({FUSED: named[FUSED],
                                        expert: named[down][3].contiguous()})
    assert differing(params(eng), eng.w0[1]) == 0, "a refused update changed the weights"
