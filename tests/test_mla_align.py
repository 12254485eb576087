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
    cfg = HarnessConfig(model=str(model_dir), numerics="rl-bitwise", prompts=DEFAULT_PROMPTS[:2],
                        **cfg)
    lines = []
    results = InvarianceHarness(cfg).run(report=lines.append)
    print(lines[0])
    return results


def _assert_passes(results, modes):
    assert {r.mode for r in results} == modes
    assert all(r.compared_values > 0 for r in results)
    diverged = [str(d) for r in results for d in r.divergences]
    assert diverged == [], "\n".join(diverged)


def test_rl_bitwise_invariance_harness_passes(model_dir):
    """CI size: alone / packed / rerun / prefix hit / chunked at an odd size / retraction /
    overlap off, T=0."""
    results = _harness(model_dir, max_new_tokens=4, temperatures=(0.0,), chunk_sizes=(7,),
                       retraction_intervals=(-3,))
    _assert_passes(results, {"packed", "rerun", "prefix-hit", "chunk-7", "retract-3", "overlap-off"})


@pytest.mark.slow
def test_rl_bitwise_invariance_harness_passes_every_mode():
    """The harness's default modes (chunks 4, 7, 256; retraction +-3) at T=0 and T=1."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_hf_model(Path(tmp) / "ds", ARCH, seed=5)
        results = _harness(model_dir, max_new_tokens=8)
    _assert_passes(results, {"packed", "rerun", "prefix-hit", "chunk-4", "chunk-7", "chunk-256",
                             "retract+3", "retract-3"})


@pytest.fixture
def lying_mla_leaf():
    """An MLA leaf that DECLARES batch invariance but, like a kernel choosing its schedule by the
    batch, runs other arithmetic on a step of more than 16 rows (a prefill) than on a small one (a
    decode step): there it rounds the softmax probabilities to the model dtype before the value
    sum, as HF's eager attention does. rl-bitwise plans it (VENDOR band)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.mla_attention import mla_paged_fixed_order
    from pallas_kernels.registry import REGISTRY, Priority

    @REGISTRY.register("attention", "mla_paged", "test_lying_leaf", formats={"bf16", "f32"},
                       hardware={"any"}, priority=Priority.VENDOR, features={"batch_invariant"})
    def lying_mla(q, latent_pages, block_tables, token_req, positions, *, v_width, scale):
        if q.shape[0] <= 16:
            return mla_paged_fixed_order(q, latent_pages, block_tables, token_req, positions,
                                         v_width=v_width, scale=scale)
        ctx = latent_pages[block_tables]
        ctx = ctx.reshape(ctx.shape[0], -1, ctx.shape[-1])[token_req]  # [T, C, W]
        s = jnp.einsum("thw,tcw->thc", q, ctx, preferred_element_type=jnp.float32) * scale
        valid = (jnp.arange(ctx.shape[1])[None, :] <= positions[:, None])[:, None, :]
        p = jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1).astype(q.dtype)
        return jnp.einsum("thc,tcv->thv", p, ctx[..., :v_width],
                          preferred_element_type=jnp.float32).astype(q.dtype)

    yield
    REGISTRY.unregister("attention", "mla_paged", "test_lying_leaf")


def test_negative_control_harness_catches_a_batch_variant_mla_leaf(model_dir, lying_mla_leaf):
    results = _harness(model_dir, max_new_tokens=3, temperatures=(0.0,), chunk_sizes=(7,),
                       retraction_intervals=())
    assert any(r.divergences for r in results if r.mode in ("packed", "chunk-7"))
