"""`jengine align` on Qwen3-MoE: HF transformers' own forward under trainer mode (its router and its
experts routed to the engine's leaves and slot-order combine) writes a dump, the engine under
--numerics rl-bitwise teacher-forces it, and every logprob matches bit for bit.

Two tiny random checkpoints (interop.testing: 8 experts, top-4, hidden 64, 2 layers): vocabulary
32768 (one rl-bitwise block) and 30000 (a partial last block). Negative control: the same HF forward
without trainer mode (its default grouped_mm experts and four-accumulator combine) does not match.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import json  # noqa: E402

from interop import trainer_mode  # noqa: E402
from interop.dumps import read_dump  # noqa: E402
from interop.testing import make_tiny_hf_model  # noqa: E402
from interop.trainer_dump import load_hf_model  # noqa: E402
from interop import trainer_dump  # noqa: E402
from interop.align import run_alignment  # noqa: E402
from tests.test_interop_align import _engine, _lines  # noqa: E402

ARCH = "Qwen3MoeForCausalLM"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("moe-align")


def _dump(workdir, model_dir, vocab: int, name: str, *extra):
    """Two short sequences (whole-sequence ids; prompt + response) with ids below ``vocab``."""
    rng = np.random.default_rng(vocab)
    lines = [{"ids": rng.integers(0, vocab, 19).tolist()},
             {"prompt_ids": rng.integers(0, vocab, 17).tolist(),
              "response_ids": rng.integers(0, vocab, 23).tolist()}]
    inputs = workdir / f"in{vocab}.jsonl"
    inputs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = workdir / name
    assert trainer_dump.main(["--hf-model", str(model_dir), "--input", str(inputs), "--out", str(out),
                              *extra]) == 0
    return out


@pytest.fixture(scope="module", params=[32768, 30000], ids=["vocab32768", "vocab30000"])
def moe(request, workdir):
    """A tiny Qwen3-MoE checkpoint, its rl-bitwise engine and dumps: trainer mode, stock torch."""
    vocab = request.param
    d = make_tiny_hf_model(workdir / f"moe{vocab}", ARCH, seed=7, vocab_size=vocab,
                           num_experts_per_tok=4)
    dumps = {"trainer": _dump(workdir, d, vocab, f"moe{vocab}.pt"),
             "stock": _dump(workdir, d, vocab, f"moe{vocab}_stock.pt", "--stock")}
    eng = _engine(d, ARCH)
    yield vocab, d, eng, dumps
    eng.shutdown()


def test_trainer_dump_aligns(moe):
    """Bit for bit; the self-consistency checks (packed / chunked) once, on the one-block vocabulary."""
    vocab, _, eng, dumps = moe
    consistency = vocab == 32768
    ok, out = _lines(run_alignment, eng, read_dump(dumps["trainer"]), self_consistency=consistency)
    assert ok, "\n".join(out)
    assert sum("MATCH (" in l for l in out if l.startswith("seq ")) == 2, out
    if not consistency:
        return
    assert any(l.startswith("self-consistency (a)") and l.endswith("MATCH") for l in out), out
    assert any(l.startswith("self-consistency (b)") and l.endswith("MATCH") for l in out), out


def test_stock_torch_dump_does_not_match(moe):
    _, _, eng, dumps = moe
    ok, out = _lines(run_alignment, eng, read_dump(dumps["stock"]), self_consistency=False)
    assert not ok and out[-1].endswith("alignment FAILED"), out
    assert any(l.startswith("seq ") and "MISMATCH at position" in l for l in out), out


def test_experts_forward_is_routed_and_differentiable(moe):
    """Trainer mode replaces every HF experts module's forward (whatever experts_implementation it
    was loaded with), restores it on leaving, and a loss still reaches the expert weights."""
    _, d, _, _ = moe
    model = load_hf_model(d)
    experts = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    assert len(experts) == 2
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with trainer_mode.enable(model) as mode:
        assert all("forward" in vars(m) for m in experts)
        model(ids).logits.float().square().sum().backward()
        assert mode.routed["moe_experts"] == 2 and mode.routed["router_topk"] == 2
        assert not mode.fallbacks, mode.summary()
    assert not any("forward" in vars(m) for m in experts)
    for m in experts:
        for p in (m.gate_up_proj, m.down_proj):
            assert p.grad is not None and bool(p.grad.abs().sum() > 0)
    assert np.isfinite(experts[0].down_proj.grad.float().numpy()).all()
