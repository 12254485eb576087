"""`jengine align` on DeepSeek-V3 (absorbed MLA): HF transformers' own forward under trainer mode
(its DeepseekV3Attention running the engine's absorbed computation through the twins,
interop/trainer_mla.py) writes a dump, the engine under --numerics rl-bitwise teacher-forces it,
and every logprob matches bit for bit; the engine's invariance harness passes on the same
checkpoint.

The tiny random checkpoint of interop.testing (q_lora 48, kv_lora 32, rope 16 interleaved with
YaRN factor 32 and mscale_all_dim 1, nope 16, v 24, two dense layers, vocab 32768). Negative
controls: HF's stock non-absorbed forward (no trainer mode) does not match, and an MLA leaf that
declares batch invariance but changes its arithmetic with the row count fails the harness.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from interop import trainer_dump, trainer_mode  # noqa: E402
from interop.align import run_alignment  # noqa: E402
from interop.dumps import read_dump  # noqa: E402
from interop.testing import make_tiny_hf_model  # noqa: E402
from interop.trainer_dump import load_hf_model  # noqa: E402
from jengine.invariance import DEFAULT_PROMPTS, HarnessConfig, InvarianceHarness  # noqa: E402
from tests.test_interop_align import _engine, _lines  # noqa: E402

ARCH = "DeepseekV3ForCausalLM"
VOCAB = 32768


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("mla-align")


@pytest.fixture(scope="module")
def model_dir(workdir):
    return make_tiny_hf_model(workdir / "ds", ARCH, seed=5)


def _dump(workdir, model_dir, name: str, *extra):
    """Two sequences (whole-sequence ids; prompt + response)."""
    rng = np.random.default_rng(11)
    lines = [{"ids": rng.integers(0, VOCAB, 19).tolist()},
             {"prompt_ids": rng.integers(0, VOCAB, 17).tolist(),
              "response_ids": rng.integers(0, VOCAB, 23).tolist()}]
    inputs = workdir / "in.jsonl"
    inputs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = workdir / name
    assert trainer_dump.main(["--hf-model", str(model_dir), "--input", str(inputs), "--out",
                              str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def aligned(workdir, model_dir):
    dumps = {"trainer": _dump(workdir, model_dir, "trainer.pt"),
             "stock": _dump(workdir, model_dir, "stock.pt", "--stock")}
    eng = _engine(model_dir, ARCH)
    yield eng, dumps
    eng.shutdown()


def test_trainer_dump_aligns(aligned):
    eng, dumps = aligned
    ok, out = _lines(run_alignment, eng, read_dump(dumps["trainer"]), self_consistency=True)
    assert ok, "\n".join(out)
    assert sum("MATCH (" in l for l in out if l.startswith("seq ")) == 2, out
    assert any(l.startswith("self-consistency (a)") and l.endswith("MATCH") for l in out), out
    assert any(l.startswith("self-consistency (b)") and l.endswith("MATCH") for l in out), out


def test_stock_non_absorbed_dump_does_not_match(aligned):
    eng, dumps = aligned
    ok, out = _lines(run_alignment, eng, read_dump(dumps["stock"]), self_consistency=False)
    assert not ok and out[-1].endswith("alignment FAILED"), out
    assert any(l.startswith("seq ") and "MISMATCH at position" in l for l in out), out


def test_mla_forward_is_routed_restored_and_differentiable(model_dir):
    model = load_hf_model(model_dir)
    attns = [m for m in model.modules() if type(m).__name__ == "DeepseekV3Attention"]
    assert len(attns) == 2
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with trainer_mode.enable(model) as mode:
        assert all("forward" in vars(m) for m in attns)
        model(ids).logits.float().square().sum().backward()
        assert mode.routed["mla_attention"] == 2
        assert not mode.fallbacks, mode.summary()
    assert not any("forward" in vars(m) for m in attns)
    for m in attns:
        for p in (m.kv_b_proj.weight, m.kv_a_proj_with_mqa.weight, m.q_a_proj.weight):
            assert p.grad is not None and bool(p.grad.abs().sum() > 0)


def _harness(model_dir, **cfg):
    cfg = HarnessConfig(model=str(model_dir), numerics="rl-bitwise", prompts=DEFAULT_PROMPTS[:3],
                        max_new_tokens=6, **cfg)
    lines = []
    results = InvarianceHarness(cfg).run(report=lines.append)
    print(lines[0])
    return results


def test_rl_bitwise_invariance_harness_passes(model_dir):
    """alone / packed / rerun / prefix hit / chunked at an odd size / retraction, T=0 and T=1."""
    results = _harness(model_dir, chunk_sizes=(7,), retraction_intervals=(-3,))
    assert {r.mode for r in results} == {"packed", "rerun", "prefix-hit", "chunk-7", "retract-3"}
    assert all(r.compared_values > 0 for r in results)
    diverged = [str(d) for r in results for d in r.divergences]
    assert diverged == [], "\n".join(diverged)
