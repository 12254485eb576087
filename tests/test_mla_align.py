"""`jengine align` on DeepSeek-V3 (absorbed MLA, DeepSeek-MoE layers): HF transformers' own forward
under trainer mode (its DeepseekV3Attention running the engine's absorbed computation through the
twins, interop/trainer_mla.py; its DeepseekV3TopkRouter and DeepseekV3Experts the grouped router's
twin and the slot-order expert path, interop/trainer_moe.py) writes a dump, the engine under
--numerics rl-bitwise teacher-forces it, and every logprob matches bit for bit; the engine's
routed-expert export equals HF's router ids under trainer mode; the engine's invariance harness
passes on the same checkpoint (EP1 here; EP4 in tests/test_expert_parallel.py).

The tiny random checkpoint of interop.testing (q_lora 48, kv_lora 32, rope 16 interleaved with
YaRN factor 32 and mscale_all_dim 1, nope 16, v 24; layer 0 dense, layers 1-2 MoE: 16 experts,
4 groups, top-4, one shared expert, a random non-zero e_score_correction_bias; vocab 32768).
Negative controls: HF's stock forward (no trainer mode: non-absorbed MLA, HF's own router and
experts) does not match, and an MLA leaf that declares batch invariance but changes its arithmetic
with the row count fails the harness.
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


def test_mla_and_moe_forwards_are_routed_restored_and_differentiable(model_dir):
    model = load_hf_model(model_dir)
    kinds = ("DeepseekV3Attention", "DeepseekV3TopkRouter", "DeepseekV3Experts")
    routed = [m for m in model.modules() if type(m).__name__ in kinds]
    assert len(routed) == 3 + 2 + 2
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with trainer_mode.enable(model) as mode:
        assert all("forward" in vars(m) for m in routed)
        model(ids).logits.float().square().sum().backward()
        assert (mode.routed["mla_attention"], mode.routed["router_grouped_topk"],
                mode.routed["moe_experts"]) == (3, 2, 2)
        assert not mode.fallbacks, mode.summary()
    assert not any("forward" in vars(m) for m in routed)
    for m in routed:
        if type(m).__name__ == "DeepseekV3Attention":
            params = (m.kv_b_proj.weight, m.kv_a_proj_with_mqa.weight, m.q_a_proj.weight)
        else:  # the router's weight through the routing weights; the experts' own
            params = (m.weight,) if hasattr(m, "weight") else (m.gate_up_proj, m.down_proj)
        for p in params:
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), type(m).__name__


def _hf_router_ids(model_dir, seq, *, trainer: bool):
    """int32[positions, MoE layers, k]: the ids HF's DeepseekV3TopkRouter picks teacher-forcing
    `seq`, under trainer mode (the grouped router's torch-leaf twin) or stock."""
    model = load_hf_model(model_dir)
    captured = []
    for layer in model.model.layers[1:]:
        layer.mlp.gate.register_forward_hook(lambda mod, args, out: captured.append(out[2]))
    with torch.no_grad():
        if trainer:
            with trainer_mode.enable(model):
                model(torch.tensor(seq)[None])
        else:
            model(torch.tensor(seq)[None])
    return np.stack([c.numpy().astype(np.int32) for c in captured], axis=1)


def test_routed_experts_export_equals_trainer_mode_router_ids(aligned, model_dir):
    """return_routed_experts (the rl-bitwise engine's torch router leaf) vs HF's router under
    trainer mode on the same sequence: every id, in slot order; layer 0 (dense) exports -1s."""
    from jengine.engine.io_struct import decode_routed_experts

    eng, _ = aligned
    prompt = np.random.default_rng(7).integers(0, VOCAB, 13).tolist()
    out = eng.generate(input_ids=prompt, return_routed_experts=True,
                       sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    seq = prompt + out["output_ids"][:-1]
    ours = decode_routed_experts(out["meta_info"]["routed_experts"], 3, 4)
    assert ours.shape == (len(seq), 3, 4) and (ours[:, 0] == -1).all()
    want = _hf_router_ids(model_dir, seq, trainer=True)
    assert (ours[:, 1:] == want).all(), np.argwhere(ours[:, 1:] != want)[:8]
    # Negative control: the comparison sees slot order -- stock HF's CPU topk(sorted=False) writes
    # the same experts in another order.
    stock = _hf_router_ids(model_dir, seq, trainer=False)
    assert (np.sort(stock, -1) == np.sort(want, -1)).mean() > 0.5 and (stock != want).any()


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
    """CI size, at EP1: alone / packed / rerun / prefix hit / chunked at an odd size / retraction /
    overlap off, T=0."""
    results = _harness(model_dir, max_new_tokens=4, temperatures=(0.0,), chunk_sizes=(7,),
                       retraction_intervals=(-3,))
    _assert_passes(results, {"packed", "rerun", "prefix-hit", "chunk-7", "retract-3", "overlap-off"})


@pytest.mark.slow
def test_rl_bitwise_invariance_harness_passes_every_mode():
    """The harness's default modes (chunks 4, 7, 256; retraction +-3; overlap off) at T=0 and
    T=1."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_hf_model(Path(tmp) / "ds", ARCH, seed=5)
        results = _harness(model_dir, max_new_tokens=8)
    _assert_passes(results, {"packed", "rerun", "prefix-hit", "chunk-4", "chunk-7", "chunk-256",
                             "retract+3", "retract-3", "overlap-off"})


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


@pytest.mark.slow  # CI time: the harness's CI control is tests/test_invariance.py's (same harness code)
def test_negative_control_harness_catches_a_batch_variant_mla_leaf(model_dir, lying_mla_leaf):
    results = _harness(model_dir, max_new_tokens=3, temperatures=(0.0,), chunk_sizes=(7,),
                       retraction_intervals=())
    assert any(r.divergences for r in results if r.mode in ("packed", "chunk-7"))
