"""DeepseekV3ForCausalLM (issue #20) against HF transformers' eager forward, its config rules, its
latent KV cache, and prefilled-vs-decoded bit equality of the absorbed MLA leaf.

One tiny random checkpoint (interop.testing: hidden 64, 4 heads, q_lora 48, kv_lora 32, rope 16
interleaved with YaRN (factor 32, mscale = mscale_all_dim = 1), nope 16, v 24; layer 0 dense,
layers 1-2 DeepSeek-MoE: 16 experts in 4 groups, 2 kept, top-4, one shared expert, a random
non-zero e_score_correction_bias; vocab 32768).

Tolerances against HF eager: fp32 1e-4 (the whole-model bound of tests/test_models_hf.py: reduction
orders differ, and HF attends over expanded keys and values -- c W_UK, c W_UV -- where we absorb
W_UK into the query and apply W_UV after the attention, the same function in another order). bf16:
the absorbed form rounds q_latent and the attention's latent output to bf16 where HF rounds the
expanded k/v and the attention output, on top of the dense body's per-op rounding drift; we bound
the logits' difference by 0.125 absolute on logits of magnitude < 8 (4 bf16 ulps there) on the rows
before the first routing difference, and require HF's routing on most rows. Those differences can
flip an expert whose biased score is within rounding of the k-th (here 3 of 24 rows): a flipped
expert is another function of the row, so from there on (that row, and later rows through attention)
the logits differ by O(1) and no rounding bound holds.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from interop.testing import make_tiny_hf_model  # noqa: E402
from jengine.config import LaunchConfig  # noqa: E402
from jengine.engine.batch import StepBatch  # noqa: E402
from jengine.engine.model_runner import ModelRunner  # noqa: E402
from jengine.launch import plan_launch  # noqa: E402
from jengine.models import load_model  # noqa: E402
from jengine.models.config import ModelConfig  # noqa: E402
from jengine.models.kv_cache import LatentPages  # noqa: E402
from jengine.numerics import resolve_launch  # noqa: E402
from tests.bits import float_bits  # noqa: E402
from tests.test_models_hf import _greedy, _prefill_logits, hf_greedy  # noqa: E402

ARCH = "DeepseekV3ForCausalLM"
RUNNER_LAUNCH = dict(page_size=4, max_total_tokens=2048, max_prefill_tokens=64,
                     max_running_requests=4)


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("deepseek-v3"), ARCH, seed=3)


@pytest.fixture(scope="module")
def loaded(ds_dir):
    return load_model(str(ds_dir), progress=False)


def _runner(ds_dir, loaded, **launch):
    resolved = resolve_launch(LaunchConfig(model_path=str(ds_dir), **RUNNER_LAUNCH, **launch),
                              hardware="cpu")
    return ModelRunner(loaded.config, loaded.checkpoint,
                       plan_launch(resolved, loaded.config).runner)


def _hf(ds_dir, dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(ds_dir), dtype=getattr(torch, dtype), attn_implementation="eager").eval()


def _hf_and_ours(ds_dir, loaded, dtype, seed):
    model, runner = _hf(ds_dir, dtype), _runner(ds_dir, loaded, dtype=dtype)
    ids = np.random.default_rng(seed).integers(0, 32768, size=24)
    with torch.no_grad():
        ref = model(torch.tensor(ids)[None]).logits[0].float().numpy()
    return model, runner, ids, _prefill_logits(runner, ids), ref


def test_config_reads_the_mla_fields(loaded):
    cfg = loaded.config
    assert (cfg.architecture, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim) == \
        (ARCH, 32, 48, 16)
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.head_dim, cfg.rope_interleave) == \
        (16, 24, 16, True)
    assert (cfg.first_k_dense_replace, cfg.num_hidden_layers, cfg.num_experts,
            cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (1, 3, 16, 4, 32)
    assert (cfg.n_group, cfg.topk_group, cfg.n_shared_experts, cfg.routed_scaling_factor,
            cfg.norm_topk_prob, cfg.router_score) == (4, 2, 1, 2.5, True, "sigmoid")


def _hf_dict(ds_dir, **changes):
    import json

    d = json.loads((ds_dir / "config.json").read_text())
    d.update(changes)
    return d


def test_dense_only_config_has_no_moe_fields(ds_dir):
    cfg = ModelConfig.from_hf_dict(_hf_dict(ds_dir, first_k_dense_replace=3))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (0, 0, 0)


@pytest.mark.parametrize("changes, pattern", [
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim=15 must be even"),
    (dict(kv_lora_rank=None), "kv_lora_rank=None must be an integer >= 1"),
    (dict(topk_method="greedy"), "topk_method='greedy' is not supported.*'noaux_tc'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported.*'sigmoid'"),
    (dict(n_routed_experts=0), "n_routed_experts=0 must be an integer >= 1"),
    (dict(n_group=3), "n_group=3 must divide n_routed_experts=16"),
    (dict(n_group=16, topk_group=2), "n_group=16 leaves groups of 1 expert"),
    (dict(topk_group=5), "topk_group=5 exceeds n_group=4"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds the 8 experts of topk_group=2"),
    (dict(routed_scaling_factor=0), "routed_scaling_factor=0 must be a positive number"),
    (dict(n_shared_experts=-1), "n_shared_experts=-1 must be an integer >= 0"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
])
def test_config_refusals_name_field_and_value(ds_dir, changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        ModelConfig.from_hf_dict(_hf_dict(ds_dir, **changes))


def test_kv_cache_is_one_latent_page_and_server_info_says_so(ds_dir):
    """One latent (kv_lora_rank + qk_rope_head_dim = 48 values) per token and layer, where HF's
    expanded cache would hold heads x (qk_head_dim + v_head_dim) = 4 x (32 + 24) = 224."""
    from jengine.engine.engine import Engine

    with Engine(model_path=str(ds_dir), dtype="bfloat16", max_total_tokens=256,
                max_prefill_tokens=32, max_running_requests=2, skip_warmup=True) as engine:
        spec = engine.runner.kv_pool.spec
        assert spec.layout == LatentPages(width=32 + 16) and len(spec.layers) == 3
        assert engine.runner.kernels.describe()["mla_attention"] == "xla_native"
        info = engine.server_info()
        out = engine.generate(input_ids=[[11, 22, 33, 44]],
                              sampling_params={"max_new_tokens": 3, "temperature": 0,
                                               "ignore_eos": True})
    assert (info["kv_values_per_token"], info["kv_bytes_per_token"]) == (3 * 48, 3 * 48 * 2)
    assert len(out[0]["output_ids"]) == 3


def test_fp32_logits_and_greedy_match_hf(ds_dir, loaded):
    model, runner, ids, ours, ref = _hf_and_ours(ds_dir, loaded, "float32", seed=1)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    prompt = ids[:8]
    assert _greedy(runner, prompt, 12) == hf_greedy(model, prompt, 12)


def test_bf16_logits_close_to_hf_until_routing_differs(ds_dir, loaded):
    """Module docstring: within 0.125 on the rows before HF's router first picks other experts (the
    routed ids exported by the step program vs HF's DeepseekV3TopkRouter, compared as sets since
    the auto router's slot order is not torch's), and HF's routing on >= 80% of (row, layer)."""
    model, runner = _hf(ds_dir, "bfloat16"), _runner(ds_dir, loaded, dtype="bfloat16")
    hf_ids = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: hf_ids.append(out[2].numpy()))
             for layer in model.model.layers[1:]]
    ids = np.random.default_rng(1).integers(0, 32768, size=24)
    with torch.no_grad():
        ref = model(torch.tensor(ids)[None]).logits[0].float().numpy()
    for hook in hooks:
        hook.remove()
    n = len(ids)
    hidden, routed = runner.forward_routed(StepBatch(
        input_ids=ids, positions=np.arange(n), token_req=np.zeros(n),
        block_tables=np.asarray([list(range(1, 8))]), hidden_rows=np.arange(n)))
    ours, routed = np.asarray(runner.compute_logits(hidden))[:n], np.asarray(routed)[:n]
    assert (routed[:, 0] == -1).all()  # layer 0 is dense
    same = np.stack([np.sort(routed[:, layer], -1) == np.sort(hf_ids[layer - 1], -1)
                     for layer in (1, 2)], axis=1).all(-1)          # [rows, MoE layers]
    assert same.mean() >= 0.8
    first_flip = int(np.argmin(same.all(-1))) if not same.all() else n
    assert first_flip >= 4
    assert np.abs(ref).max() < 8
    assert np.abs(ours[:first_flip] - ref[:first_flip]).max() <= 0.125


def test_prefilled_and_decoded_tokens_have_the_same_bits(ds_dir, loaded):
    """rl-bitwise (the fixed-order MLA leaf): a token's logits are the same bits whether its row
    was in a 20-row prefill or decoded one row at a time over the latent pages (other pages than
    the prefill's) that a 9-token prefill and the decode steps wrote."""
    runner = _runner(ds_dir, loaded, numerics="rl-bitwise")
    assert runner.kernels.describe()["mla_attention"] == "fixed_order"
    ids = np.random.default_rng(5).integers(0, 32768, size=20)
    prefilled = _prefill_logits(runner, ids)
    table = np.asarray([list(range(101, 165))])
    k = 9
    runner.forward(StepBatch(input_ids=ids[:k], positions=np.arange(k), token_req=np.zeros(k),
                             block_tables=table, hidden_rows=[k - 1]))
    for pos in range(k, len(ids)):
        hidden = runner.forward(StepBatch(input_ids=[ids[pos]], positions=[pos], token_req=[0],
                                          block_tables=table, hidden_rows=[0]))
        decoded = np.asarray(runner.compute_logits(hidden))[0]
        assert (float_bits(decoded) == float_bits(prefilled[pos])).all(), pos
