"""Startup refusals end to end: `jengine generate` exits non-zero and `Engine(...)` raises, each with
the rule and the values, for every model an rl-bitwise launch cannot serve."""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jengine import Engine  # noqa: E402
from jengine.numerics import NumericsRefusal  # noqa: E402

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64)


def _save(tmp_path_factory, name, model, config_patch=None):
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    from jengine.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / f).write_bytes((tiny / f).read_bytes())
    if config_patch:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config_patch)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    qwen3 = lambda v: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(vocab_size=v, **TINY))  # noqa: E731
    return {
        "quantized": _save(tmp_path_factory, "quant", qwen3(32768),
                           {"quantization_config": {"quant_method": "fp8"}}),
        "undeclared": _save(tmp_path_factory, "llama", transformers.LlamaForCausalLM(
            transformers.LlamaConfig(vocab_size=32768, **TINY))),
    }


CASES = {
    "quantized": "quantiz",
    "undeclared": "require_verified_numerics",
}


# Every in-tree family declares rl-bitwise, so "undeclared" withdraws Llama's declaration for the
# run (in the subprocess too) to stand for an architecture that has not earned it.
UNDECLARE = ("from jengine.profiles import override_profile; import sys, jengine.cli as c; "
             "ctx = override_profile('LlamaForCausalLM', numerics_envelopes=set()) "
             "if {undeclared} else None; ctx and ctx.__enter__(); sys.exit(c.main(sys.argv[1:]))")


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_refuses_at_startup(models, case):
    from jengine.profiles import override_profile

    with override_profile("LlamaForCausalLM", numerics_envelopes=set()):
        with pytest.raises(NumericsRefusal, match=CASES[case]):
            Engine(model_path=str(models[case]), numerics="rl-bitwise", skip_warmup=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_exits_nonzero_with_the_reason(models, case):
    code = UNDECLARE.format(undeclared=case == "undeclared")
    proc = subprocess.run(
        [sys.executable, "-c", code, "generate", "--model", str(models[case]),
         "--numerics", "rl-bitwise", "--prompt", "hi", "--max-new-tokens", "1", "--skip-warmup"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert CASES[case] in proc.stderr, proc.stderr[-2000:]


def test_moe_tp_and_sampling_refusals_name_the_switch():
    with pytest.raises(NumericsRefusal, match="moe-tp-size"):
        Engine(model_path="tiny", numerics="rl-bitwise", moe_tp_size=2, skip_warmup=True)
    with pytest.raises(NumericsRefusal, match="sampling-stream"):
        Engine(model_path="tiny", numerics="rl-bitwise", sampling_stream="batch", skip_warmup=True)


def test_the_same_models_start_under_auto(models):
    # The refusals are the envelope's, not the loader's: auto serves the undeclared model.
    with Engine(model_path=str(models["undeclared"]), numerics="auto", skip_warmup=True) as eng:
        out = eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2,
                                                                 "temperature": 0})
        assert len(out["output_ids"]) == 2


# Run a command with torch and transformers unimportable, as after the README's plain install.
NO_TORCH = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "import runpy; sys.argv = {argv!r}; runpy.run_module({module!r}, run_name='__main__')")


@pytest.mark.parametrize("module, argv, command", [
    ("jengine.cli", ["jengine", "ops-report"], "jengine ops-report"),
    ("jengine.cli", ["jengine", "align", "--dump", "{dump}"], "jengine align"),
    ("interop.trainer_dump", ["trainer_dump", "--hf-model", "m", "--input", "i", "--out", "o"],
     "python -m interop.trainer_dump"),
])
def test_torch_side_commands_without_torch_say_how_to_install(module, argv, command, tmp_path):
    dump = tmp_path / "dump.pt"
    dump.write_bytes(b"not read without torch")
    argv = [a.format(dump=dump) for a in argv]
    proc = subprocess.run([sys.executable, "-c", NO_TORCH.format(argv=argv, module=module)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{command} needs" in proc.stderr and "pip install 'jengine[torch]'" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_missing_dump_is_a_clean_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jengine.cli", "align", "--dump",
                           str(tmp_path / "missing.pt")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "trainer dump not found" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
