"""Orbax checkpoints (`jengine convert`, jengine/models/orbax_checkpoint.py): a model directory
converted to Orbax loads as the same model, bit for bit -- parameters, greedy ids and logprob
bits -- in process at TP1 and at TP2 on 8 fake devices (tests/orbax_probe.py), and serves as a
weight update from disk. Negative controls: a renamed parameter and a wrong shape are refused
naming the parameter; W0 and W1 serve different bits, so the equalities can fail.

W0 and W1: the session's tiny random Qwen3 checkpoints (tests/conftest.py), each converted once.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from jengine import Engine
from jengine.cli import main as cli_main
from jengine.convert import convert
from jengine.engine.request import InvalidRequest
from jengine.models import load_model
from jengine.models.orbax_checkpoint import FORMAT, ORBAX_DIR
from tests.bits import count_bit_differences
from tests.fake_devices import run_probe

LAUNCH = dict(numerics="rl-bitwise", skip_warmup=True, page_size=4, chunked_prefill_size=8,
              max_total_tokens=512)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def converted(ckpts, tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax")
    for name, path in ckpts.items():
        assert convert(str(path), root / name, progress=False) > 0
    return {name: root / name for name in ckpts}


def record(eng) -> tuple:
    """Greedy ids and the logprob bits of prompt and continuation."""
    out = eng.generate(input_ids=PROMPT, return_logprob=True, logprob_start_len=0,
                       sampling_params=dict(max_new_tokens=5, temperature=0, ignore_eos=True))
    meta = out["meta_info"]
    lps = [t[0] for t in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
    return out["output_ids"], np.asarray(lps, np.float32).view(np.uint32).tolist()


def param_differences(a, b) -> dict:
    pa, pb = (e.runner._model(e.runner._params).named_parameters() for e in (a, b))
    assert pa.keys() == pb.keys()
    return {p: n for p in pa if (n := count_bit_differences(pa[p], pb[p]))}


def test_convert_writes_a_loadable_model_directory(ckpts, converted):
    src, dst = ckpts["w0"], converted["w0"]
    assert not list(dst.glob("*.safetensors"))
    for name in ("config.json", "tokenizer.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    hf, orbax = load_model(str(src), progress=False), load_model(str(dst))
    assert type(orbax.checkpoint).__name__ == "OrbaxCheckpoint" and orbax.config == hf.config
    # The HF view the launch and update checks read: the same names, shapes and stored dtypes.
    assert sorted(orbax.checkpoint.names()) == sorted(hf.checkpoint.names())
    for name in hf.checkpoint.names():
        assert orbax.checkpoint.shape(name) == hf.checkpoint.shape(name)
        assert orbax.checkpoint.dtype(name) == hf.checkpoint.dtype(name)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert count_bit_differences(orbax.checkpoint.read(name), hf.checkpoint.read(name)) == 0
    meta = json.loads((dst / ORBAX_DIR / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]
    assert meta["format"] == FORMAT
    q = meta["params"]["layers.0.self_attn.q_proj.weight"]
    assert (q["checkpoint"], q["transpose"], q["axes"]) == (name, True, ["embed", "heads"])


def test_convert_refuses_a_missing_source_and_a_used_destination(converted, tmp_path, capsys):
    assert cli_main(["convert", str(tmp_path / "absent"), str(tmp_path / "out")]) == 2
    assert "model directory not found" in capsys.readouterr().err
    assert cli_main(["convert", "tiny", str(converted["w0"])]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err


@pytest.fixture(scope="module")
def renamed(converted, tmp_path_factory):
    """W0's conversion with one parameter stored under another path."""
    import orbax.checkpoint as ocp

    out = tmp_path_factory.mktemp("renamed") / "w0"
    shutil.copytree(converted["w0"], out, ignore=shutil.ignore_patterns(ORBAX_DIR))
    checkpointer = ocp.StandardCheckpointer()
    source = converted["w0"] / ORBAX_DIR
    tree = checkpointer.restore(source)
    mlp = tree["layers"]["0"]["mlp"]
    mlp["up_projection"] = mlp.pop("up_proj")
    checkpointer.save(out / ORBAX_DIR, tree,
                      custom_metadata=checkpointer.metadata(source).custom_metadata)
    checkpointer.wait_until_finished()
    return out


def test_a_renamed_or_reshaped_parameter_is_refused_naming_it(converted, renamed, tmp_path):
    with pytest.raises(ValueError, match=r"'layers\.0\.mlp\.up_proj\.weight' .*is not in the "
                       r"Orbax checkpoint .*it holds 'layers\.0\.mlp\.up_projection\.weight'"):
        load_model(str(renamed))
    # config.json promising a wider MLP than the arrays hold
    reshaped = tmp_path / "reshaped"
    shutil.copytree(converted["w0"], reshaped)
    config = json.loads((reshaped / "config.json").read_text())
    wider = config["intermediate_size"] + 8
    (reshaped / "config.json").write_text(json.dumps({**config, "intermediate_size": wider}))
    with pytest.raises(ValueError, match=r"parameter 'layers\.0\.mlp\.gate_proj\.weight' in the "
                       r"Orbax checkpoint .* has shape \(\d+, \d+\), but the model expects "
                       rf"\(\d+, {wider}\)"):
        load_model(str(reshaped))


def test_engine_from_orbax_serves_the_safetensors_engines_bits(ckpts, converted, renamed):
    with Engine(model_path=str(ckpts["w0"]), **LAUNCH) as hf, \
            Engine(model_path=str(converted["w0"]), **LAUNCH) as orbax:
        assert param_differences(hf, orbax) == {}
        w0 = record(hf)
        assert record(orbax) == w0
        # A weight update from disk reads an Orbax directory too; a bad one leaves W0 serving.
        with pytest.raises(InvalidRequest, match=r"up_proj\.weight"):
            orbax.update_weights_from_disk(str(renamed))
        assert record(orbax) == w0
        hf.update_weights_from_disk(str(ckpts["w1"]))
        orbax.update_weights_from_disk(str(converted["w1"]))
        assert param_differences(hf, orbax) == {}
        w1 = record(hf)
        assert w1 != w0 and record(orbax) == w1


def test_tp2_restores_onto_the_placement_with_the_safetensors_bits():
    probe = run_probe("orbax_probe.py")
    assert probe["devices"] == 8 and probe["checkpoint"] == "OrbaxCheckpoint"
    # Restored straight onto the column-parallel placement: each rank holds half the columns.
    assert probe["restored_q_proj_spec"] == "P(None, 'tensor')"
    assert probe["restored_q_proj_local_shape"][1] * 2 == probe["restored_q_proj_shape"][1]
    assert probe["restored_unplaced"] == [] and probe["shardings_differing"] == []
    assert probe["params"] > 0 and probe["params_differing"] == {}
    assert probe["logits_elements"] > 0 and probe["logits_differing"] == 0
    assert probe["greedy_ids_equal"]


def test_moe_experts_convert_stacked_and_serve_the_safetensors_bits(moe_ckpts, tmp_path):
    """Qwen3-MoE: each layer's experts are one stacked path per projection, recorded as the
    per-expert name pattern; the HF view names every expert's tensor; the engines' parameter bits,
    greedy ids and logprob bits are the safetensors engine's."""
    src, dst = moe_ckpts["w0"], tmp_path / "moe"
    assert convert(str(src), dst, progress=False) > 0
    meta = json.loads((dst / ORBAX_DIR / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]
    gate = meta["params"]["layers.1.mlp.experts.gate_proj"]
    assert (gate["checkpoint"], gate["stacked"], gate["axes"], gate["stored_shape"]) == (
        "model.layers.1.mlp.experts.{}.gate_proj.weight", 8, ["expert", "embed", "expert_mlp"],
        [32, 64])
    hf, orbax = load_model(str(src), progress=False), load_model(str(dst))
    assert sorted(orbax.checkpoint.names()) == sorted(hf.checkpoint.names())
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    assert orbax.checkpoint.shape(name) == hf.checkpoint.shape(name) == (64, 32)
    assert count_bit_differences(orbax.checkpoint.read(name), hf.checkpoint.read(name)) == 0
    with Engine(model_path=str(src), **LAUNCH) as hf_eng, \
            Engine(model_path=str(dst), **LAUNCH) as orbax_eng:
        assert param_differences(hf_eng, orbax_eng) == {}
        assert record(orbax_eng) == record(hf_eng)
