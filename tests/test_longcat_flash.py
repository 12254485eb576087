"""LongcatFlashForCausalLM (issue #20, LongCat part) against HF transformers 5.24's
`models/longcat_flash`: config rules, two latent caches per layer, logits vs HF's eager forward,
`--mla-lora-scale` (what runtime and folded change), `jengine align` MATCH under trainer mode (the
absorbed MLA with HF's runtime LoRA scales, the softmax router and the zero experts through the
twins) with the stock-torch control diverging, and the rl-bitwise invariance harness.

One tiny random checkpoint (interop.testing: hidden 64, 2 layers = 4 MLA blocks, 4 heads, q_lora
48, kv_lora 32, rope 16 interleaved, nope 16, v 24, 8 real + 4 zero experts, 3 per token,
routed_scaling_factor 6, a non-zero correction bias, vocab 32768).

Tolerances against HF eager, and why: fp32 1e-4 (the whole-model bound of tests/test_models_hf.py;
HF attends over expanded keys and values where the engine absorbs). bf16: the absorbed MLA, the
slot-order expert fold and the weight inside the activation are other roundings than HF's, and a
router decision near a tie can flip between them (a whole expert's term changes), so bf16 is held
to HF's fp32 logits with HF's own bf16 error as the yardstick (mean error, top-1 on most rows; the
test says the factors and why); the bitwise claims are the trainer-mode alignment and the harness.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "LongcatFlashForCausalLM"):
    pytest.skip("the installed transformers has no LongcatFlashForCausalLM", allow_module_level=True)

from interop import trainer_mode  # noqa: E402
from interop.align import run_alignment  # noqa: E402
from interop.dumps import read_dump  # noqa: E402
from interop.testing import make_tiny_hf_model  # noqa: E402
from interop.trainer_dump import load_hf_model  # noqa: E402
from jengine.models import load_model  # noqa: E402
from jengine.models.config import ModelConfig  # noqa: E402
from jengine.models.kv_cache import LatentPages  # noqa: E402
from tests.bits import float_bits  # noqa: E402
from tests.test_deepseek_v3 import _runner  # noqa: E402
from tests.test_interop_align import _engine, _lines  # noqa: E402
from tests.test_mla_align import _assert_passes, _dump, _harness  # noqa: E402
from tests.test_models_hf import _greedy, _prefill_logits, hf_greedy  # noqa: E402

ARCH = "LongcatFlashForCausalLM"
VOCAB = 32768


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("longcat")


@pytest.fixture(scope="module")
def model_dir(workdir):
    return make_tiny_hf_model(workdir / "lc", ARCH, seed=3)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(str(model_dir), progress=False)


def _hf_dict(model_dir, **changes):
    d = json.loads((model_dir / "config.json").read_text())
    d.update(changes)
    return d


def test_config_reads_longcat_names(loaded):
    cfg = loaded.config
    assert (cfg.num_hidden_layers, cfg.intermediate_size, cfg.num_experts, cfg.zero_expert_num,
            cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (2, 128, 8, 4, 3, 32)
    assert (cfg.router_score, cfg.n_group, cfg.norm_topk_prob, cfg.routed_scaling_factor) == \
        ("softmax", 1, False, 6.0)
    assert cfg.mla_lora_scale and cfg.rope_interleave and cfg.head_dim == cfg.qk_rope_head_dim


@pytest.mark.parametrize("change, message", [
    (dict(router_bias=True), "router_bias=True is not supported"),
    (dict(head_dim=32), "head_dim=32 must equal qk_rope_head_dim=16"),
    (dict(qk_head_dim=40), "qk_head_dim=40 must equal qk_nope_head_dim"),
    (dict(num_hidden_layers=3), r"num_hidden_layers=3 must be 2 \* num_layers=4"),
    (dict(moe_topk=13), "moe_topk=13 exceeds n_routed_experts \\+ zero_expert_num = 12"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
])
def test_config_refusals_name_the_field(model_dir, change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(_hf_dict(model_dir, **change))


def test_two_latent_caches_per_layer_and_ep_refused(model_dir, loaded):
    from jengine.launch import LaunchRefusal
    from jengine.models.registry import get_family

    cfg = ModelConfig.from_hf_dict(_hf_dict(model_dir))
    spec = get_family(ARCH).kv_cache_spec(cfg)
    assert spec.layout == LatentPages(width=32 + 16) and len(spec.layers) == 2 * 2
    with pytest.raises(LaunchRefusal, match="--ep-size 2: .*zero_expert_num=4.*--ep-size 1"):
        _runner(model_dir, loaded, ep_size=2)


def _hf_logits(model_dir, dtype, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), attn_implementation="eager").eval()
    with torch.no_grad():
        return model, model(torch.tensor(ids)[None]).logits[0].float().numpy()


def test_fp32_logits_and_greedy_match_hf(model_dir, loaded):
    ids = np.random.default_rng(1).integers(0, VOCAB, size=24)
    model, ref = _hf_logits(model_dir, "float32", ids)
    runner = _runner(model_dir, loaded, dtype="float32", mla_lora_scale="runtime")
    np.testing.assert_allclose(_prefill_logits(runner, ids), ref, rtol=1e-4, atol=1e-4)
    assert _greedy(runner, ids[:8], 10) == hf_greedy(model, ids[:8], 10)


def test_bf16_lora_scale_runtime_and_folded(model_dir, loaded):
    """Both forms serve HF's model, measured against HF's fp32 logits with HF's own bf16 forward
    as the yardstick: a mean error at most 4x HF bf16's and fp32's top-1 on at least 75 % of the
    rows. (Measured with transformers 5.25: runtime 0.93x and 96 %, folded 2.8x and 88 %, HF bf16
    100 %; folded rounds w * s once into each norm weight, which moves every token's normalised
    activations, hence the 4x. Means, not maxima: one router decision near a tie changes a
    whole expert's term in a row.) They are other bits: runtime rounds q * s_q and c * s_kv."""
    ids = np.random.default_rng(2).integers(0, VOCAB, size=24)
    _, ref = _hf_logits(model_dir, "float32", ids)
    _, hf_bf16 = _hf_logits(model_dir, "bfloat16", ids)
    yardstick = np.abs(hf_bf16 - ref).mean()
    assert 0 < yardstick < 0.1, yardstick  # bf16 noise, not a broken reference
    logits = {}
    for form in ("runtime", "folded"):
        logits[form] = _prefill_logits(_runner(model_dir, loaded, mla_lora_scale=form), ids)
        assert np.abs(logits[form] - ref).mean() <= 4 * yardstick, form
        assert (logits[form].argmax(-1) == ref.argmax(-1)).mean() >= 0.75, form
    assert (float_bits(logits["runtime"]) != float_bits(logits["folded"])).any()


def test_rl_bitwise_pins_runtime(model_dir, loaded):
    """The trainer's form: rl-bitwise tightens even an explicit folded to runtime (spec table)."""
    for given in ({}, {"mla_lora_scale": "folded"}):
        runner = _runner(model_dir, loaded, numerics="rl-bitwise", **given)
        assert runner.options.mla_lora_scale == "runtime"


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
    assert sum("MATCH (" in line for line in out if line.startswith("seq ")) == 2, out


def test_stock_dump_does_not_match(aligned):
    eng, dumps = aligned
    ok, out = _lines(run_alignment, eng, read_dump(dumps["stock"]), self_consistency=False)
    assert not ok and out[-1].endswith("alignment FAILED"), out


def test_trainer_mode_routes_and_restores_every_longcat_module(model_dir):
    """Every MLA block, router and experts module runs the twins (zero experts hit), no torch
    fallback on the path, a loss differentiates it, and disable() gives HF's forwards back."""
    model = load_hf_model(model_dir)
    names = ("LongcatFlashMLA", "LongcatFlashTopkRouter", "LongcatFlashExperts")
    modules = [m for m in model.modules() if type(m).__name__ in names]
    assert len(modules) == 2 * 2 + 2 + 2
    ids = torch.tensor([np.random.default_rng(4).integers(0, VOCAB, 16).tolist()])
    zero_hits = []
    router = next(m for m in modules if type(m).__name__ == "LongcatFlashTopkRouter")
    hook = router.register_forward_hook(lambda m, i, out: zero_hits.append(
        bool((out[2] >= model.config.n_routed_experts).any())))
    with trainer_mode.enable(model) as mode:
        assert all("forward" in vars(m) for m in modules)
        model(ids).logits.float().square().sum().backward()
        assert (mode.routed["mla_attention"], mode.routed["router_grouped_topk"],
                mode.routed["moe_experts"]) == (4, 2, 2)
        assert not mode.fallbacks, mode.summary()
    hook.remove()
    assert zero_hits == [True]
    assert not any("forward" in vars(m) for m in modules)
    assert model.model.layers[0].mlp.router.classifier.weight.grad is not None


@pytest.mark.slow  # CI time: LongCat's MLA and MoE pieces run the harness in CI as DeepSeek-V3
def test_rl_bitwise_invariance_harness_passes(model_dir):
    """CI size: alone / packed / rerun / prefix hit / overlap off, T=0 (chunking and retraction are
    the engine's, covered on every other family in CI; the slow test below adds them here)."""
    results = _harness(model_dir, max_new_tokens=4, temperatures=(0.0,), chunk_sizes=(),
                       retraction_intervals=())
    _assert_passes(results, {"packed", "rerun", "prefix-hit", "overlap-off"})


@pytest.mark.slow
def test_rl_bitwise_invariance_harness_passes_chunked_and_retracted(model_dir):
    """The same with a chunk of odd size and retraction, T=0."""
    results = _harness(model_dir, max_new_tokens=4, temperatures=(0.0,), chunk_sizes=(7,),
                       retraction_intervals=(-3,))
    _assert_passes(results, {"packed", "rerun", "prefix-hit", "chunk-7", "retract-3", "overlap-off"})


def test_router_replacement_returns_what_the_installed_moe_block_unpacks():
    """transformers 5.24's LongcatFlashTopkRouter returns (logits, weights, ids), 5.17's (weights,
    ids) (its MoE block unpacks two: the H200 machine's version failed on three). The replacement
    reads the arity from the installed forward's source."""
    from interop.trainer_moe import _returns_logits
    from transformers.models.longcat_flash import modeling_longcat_flash as hf

    class TwoValueRouter:  # 5.17's shape of the method
        def forward(self, hidden_states):
            if hidden_states is None:
                return None
            weights, ids = hidden_states.topk(2)
            return weights.float(), ids

    assert _returns_logits(hf.LongcatFlashTopkRouter) == ("_, topk_weights, topk_indices = "
                                                           "self.router" in _moe_source(hf))
    assert _returns_logits(TwoValueRouter) is False


def _moe_source(hf):
    import inspect

    return inspect.getsource(hf)
