"""`jengine align` end to end: HF transformers' own forward under trainer mode writes a dump, the engine
under --numerics rl-bitwise teacher-forces it, and every logprob matches bit for bit.

Negative controls: a stock-torch dump and a dump with one perturbed logprob are reported at the
right position with the right values; the two signed-zero logprob forms are told apart.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from interop import align, trainer_dump
from interop.align import format_f32, run_alignment, teacher_force
from interop.dumps import read_dump, write_dump
from interop.testing import make_certain_token_model, make_tiny_hf_model
from jengine.engine.engine import Engine
from jengine.profiles import override_profile
from tests.fake_devices import ROOT, fake_device_env

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
LAUNCH = dict(numerics="rl-bitwise", skip_warmup=True, max_total_tokens=8192,
              chunked_prefill_size=128, max_prefill_tokens=256)

CHAT = [
    {"role": "system", "content": "You are a careful assistant that explains Python internals."},
    {"role": "user", "content": "How does the garbage collector in CPython decide when to run a "
     "collection, and what is the difference between reference counting and the generational cycle "
     "detector? Please give an example with a reference cycle between two objects."},
    {"role": "assistant", "content": "CPython frees most objects through reference counting: every "
     "object keeps a count of the references that point to it, and when the count drops to zero the "
     "object is deallocated immediately. Reference counting cannot reclaim cycles, so the gc module "
     "adds a generational collector. New container objects start in generation 0; when the number "
     "of allocations minus deallocations exceeds a threshold, generation 0 is collected, and "
     "survivors move to generation 1, then 2. For example, a = []; b = [a]; a.append(b); del a, b "
     "leaves two lists that refer to each other, and only the cycle detector can free them."},
]


def _inputs(path, seed=0):
    rng = np.random.default_rng(seed)
    lines = [{"ids": rng.integers(0, 32768, 19).tolist()},
             {"prompt_ids": rng.integers(0, 32768, 17).tolist(),
              "response_ids": rng.integers(0, 32768, 23).tolist()},
             {"messages": CHAT}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _engine(model_dir, arch, **overrides):
    with override_profile(arch, numerics_envelopes={"rl-bitwise"}):
        return Engine(model_path=str(model_dir), **{**LAUNCH, **overrides})


def _dump(tmp, model_dir, name, *extra):
    out = tmp / name
    assert trainer_dump.main(["--hf-model", str(model_dir), "--input", str(_inputs(tmp / "in.jsonl")),
                              "--out", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("align")


@pytest.fixture(scope="module")
def qwen3(workdir):
    """The Qwen3 model, its engine, and dumps: trainer mode (.pt), stock torch (.safetensors)."""
    d = make_tiny_hf_model(workdir / "qwen3", "Qwen3ForCausalLM", seed=3)
    dumps = {"trainer": _dump(workdir, d, "q3.pt"),
             "stock": _dump(workdir, d, "q3_stock.safetensors", "--stock", "--record-states", "16")}
    eng = _engine(d, "Qwen3ForCausalLM")
    yield d, eng, dumps
    eng.shutdown()


def _lines(fn, *args, **kwargs):
    out: list[str] = []
    ok = fn(*args, out=out.append, **kwargs)
    return ok, out


def test_qwen3_aligns_with_self_consistency(qwen3):
    _, eng, dumps = qwen3
    records = read_dump(dumps["trainer"])
    assert len(records[2]["ids"]) > 200 and records[2]["prompt_len"]  # the chat-formatted one
    ok, out = _lines(run_alignment, eng, records, self_consistency=True)
    assert ok, "\n".join(out)
    seq_lines = [l for l in out if l.startswith("seq ")]
    assert len(seq_lines) == 3 and all("MATCH (" in l for l in seq_lines), out
    assert any(l.startswith("self-consistency (a)") and l.endswith("MATCH") for l in out), out
    assert any(l.startswith("self-consistency (b)") and l.endswith("MATCH") for l in out), out


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_llama_and_qwen2_align(workdir, arch):
    d = make_tiny_hf_model(workdir / arch, arch, seed=ARCHS.index(arch))
    dump = _dump(workdir, d, f"{arch}.safetensors")
    with _engine(d, arch) as eng:
        ok, out = _lines(run_alignment, eng, read_dump(dump), self_consistency=False)
    assert ok and sum("MATCH (" in l for l in out) == 3, "\n".join(out)


def test_stock_torch_dump_reports_first_divergence(qwen3):
    """Negative control: the same HF forward without trainer mode. The report names the first
    divergent position and both values, checked here against an independent comparison."""
    _, eng, dumps = qwen3
    records = read_dump(dumps["stock"])
    engine_lps = teacher_force(eng, [r["ids"].tolist() for r in records], packed=False)
    ok, out = _lines(run_alignment, eng, records, self_consistency=False, bisect=True)
    assert not ok and out[-1].endswith("alignment FAILED")
    seq_lines = [l for l in out if l.startswith("seq ")]
    for rec, mine, line in zip(records, engine_lps, seq_lines):
        neq = np.nonzero(mine.view(np.uint32) != rec["logprob"].view(np.uint32))[0]
        assert len(neq), "stock torch should differ from the engine somewhere"
        j = int(neq[0])
        assert (f"MISMATCH at position {j + 1}: engine {format_f32(mine[j])} vs dump "
                f"{format_f32(rec['logprob'][j])}") in line, line
        assert f"{len(neq)} of {len(mine)} positions differ" in line
    assert any(l.strip().startswith("bisect: first differing state layers.") for l in out), out


def test_perturbed_logprob_is_caught_at_its_position(qwen3, workdir):
    _, eng, dumps = qwen3
    records = read_dump(dumps["trainer"])
    k = 11
    lp = records[1]["logprob"].copy()
    lp[k] = np.nextafter(lp[k], np.float32(0))  # one ulp
    records[1]["logprob"] = lp
    write_dump(workdir / "perturbed.pt", records)
    ok, out = _lines(run_alignment, eng, read_dump(workdir / "perturbed.pt"), self_consistency=False)
    assert not ok
    assert "MATCH (" in out[0] and "MATCH (" in out[2], out
    assert f"MISMATCH at position {k + 1}:" in out[1] and "1 ulp" in out[1]
    assert "1 of 39 positions differ" in out[1], out[1]


def test_cli_exit_status(qwen3, workdir):
    from jengine.cli import main

    d, _, dumps = qwen3
    common = ["--model", str(d), "--allow-unverified-profile", "--skip-warmup",
              "--no-self-consistency", "--max-total-tokens", "8192"]
    assert main(["align", "--dump", str(dumps["trainer"]), *common]) == 0
    assert main(["align", "--dump", str(workdir / "perturbed.pt"), *common]) == 1



def test_cli_at_tp2_matches_with_tp_batch_invariant_all_and_not_with_off(qwen3):
    """Trainer alignment at TP2 (8 fake CPU devices, a subprocess each: XLA reads the device count
    once per process). With `all` every reduction is the trainer's full-K association, so the dump
    matches; with `off` o_proj and down_proj fold two rank partials, which is not -- the control."""
    d, _, dumps = qwen3
    command = [sys.executable, "-m", "jengine.cli", "align", "--dump", str(dumps["trainer"]),
               "--model", str(d), "--allow-unverified-profile", "--skip-warmup",
               "--no-self-consistency", "--max-total-tokens", "8192", "--tp-size", "2"]
    runs = {layout: subprocess.run([*command, "--tp-batch-invariant", layout], cwd=ROOT,
                                   env=fake_device_env(8), capture_output=True, text=True,
                                   timeout=600)
            for layout in ("all", "off")}
    report = {layout: run.stdout + run.stderr[-2000:] for layout, run in runs.items()}
    assert runs["all"].returncode == 0, report["all"]
    assert "3 of 3 sequences MATCH the dump bit for bit" in runs["all"].stdout, report["all"]
    assert runs["off"].returncode == 1, report["off"]
    assert "alignment FAILED" in runs["off"].stdout, report["off"]

def test_signed_zero_forms(workdir):
    """A model whose next token is certain: neg-ce writes -0.0, direct +0.0; each aligns only with
    its own --logprob-order, and the cross pair is reported as a sign-of-zero mismatch."""
    d = make_certain_token_model(workdir / "certain", "Qwen3ForCausalLM", tokens=(1000, 2000))
    rng = np.random.default_rng(5)
    (workdir / "certain.jsonl").write_text(
        json.dumps({"ids": rng.choice([1000, 2000], 40).tolist()}) + "\n")
    dumps = {}
    for form in ("neg-ce", "direct"):
        dumps[form] = workdir / f"certain_{form}.pt"
        assert trainer_dump.main(["--hf-model", str(d), "--input", str(workdir / "certain.jsonl"),
                                  "--out", str(dumps[form]), "--logprob-form", form]) == 0
    neg, direct = (read_dump(dumps[f])[0]["logprob"] for f in ("neg-ce", "direct"))
    zeros = neg == 0
    assert zeros.sum() >= 5, "the model should make some next tokens certain"
    assert np.signbit(neg[zeros]).all() and not np.signbit(direct[zeros]).any()
    for order, good, bad in (("blockwise", "neg-ce", "direct"), ("blockwise-direct", "direct", "neg-ce")):
        with _engine(d, "Qwen3ForCausalLM", logprob_order=order) as eng:
            ok, out = _lines(run_alignment, eng, read_dump(dumps[good]), self_consistency=False)
            assert ok, out
            ok, out = _lines(run_alignment, eng, read_dump(dumps[bad]), self_consistency=False)
            assert not ok and "different sign of zero" in out[0], out
            assert f"{int(zeros.sum())} of 39 positions differ" in out[0], out


def test_describe_formats():
    c = align.compare_logprobs(np.array([-1.5, -0.0], np.float32), np.array([-1.5, 0.0], np.float32))
    assert align.describe(c) == ("MISMATCH at position 2: engine -0.0 (0x80000000) vs dump 0.0 "
                                 "(0x00000000), 0 ulp (same value, different sign of zero); "
                                 "1 of 2 positions differ")
