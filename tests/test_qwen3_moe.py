"""Qwen3MoeForCausalLM (issue #18, one device) against HF transformers' eager forward, the MoE launch
rules, and the MoE block's batch invariance.

One tiny random checkpoint (interop.testing: 8 experts, top-2, moe_intermediate_size 32, hidden 64,
2 layers, vocab 32768), written by transformers' save_pretrained (one tensor per expert).

Tolerances against HF eager (attention and experts both eager): fp32 1e-4 (whole-model bound of
tests/test_models_hf.py; reduction orders differ). bf16: HF adds a token's expert outputs in
ascending expert id into a bf16 running sum (a rounding per add) where we fold the slots in f32 and
round once, on top of the dense body's per-op rounding drift; we bound the logits' difference by
0.125 absolute on logits of magnitude < 8 (4 bf16 ulps there) and require the top-1 token to agree
where HF's margin exceeds 0.25.
"""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from interop.testing import make_tiny_hf_model  # noqa: E402
from jengine.config import LaunchConfig, LaunchRefusal  # noqa: E402
from jengine.engine.engine import Engine  # noqa: E402
from jengine.engine.model_runner import ModelRunner  # noqa: E402
from jengine.launch import plan_launch  # noqa: E402
from jengine.models import load_model  # noqa: E402
from jengine.models.layers.moe import SparseMoE  # noqa: E402
from jengine.models.layers.moe_routed import layout_rows  # noqa: E402
from jengine.models.layers.param import RandomSource  # noqa: E402
from jengine.models.moe_decoder import ModelKernels  # noqa: E402
from jengine.numerics import resolve_launch  # noqa: E402
from pallas_kernels.fixed_order import sequential_dot  # noqa: E402
from pallas_kernels.registry import REGISTRY, KernelPlanError  # noqa: E402
from tests.test_models_hf import _greedy, _prefill_logits, hf_greedy  # noqa: E402

ARCH = "Qwen3MoeForCausalLM"
RUNNER_LAUNCH = dict(page_size=4, max_total_tokens=2048, max_prefill_tokens=64,
                     max_running_requests=4)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen3-moe"), ARCH)


@pytest.fixture(scope="module")
def loaded(moe_dir):
    return load_model(str(moe_dir), progress=False)


def _plan(moe_dir, loaded, **launch):
    resolved = resolve_launch(LaunchConfig(model_path=str(moe_dir), **RUNNER_LAUNCH, **launch),
                              hardware="cpu")
    return plan_launch(resolved, loaded.config)


def _hf_and_ours(moe_dir, loaded, dtype, seed):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(moe_dir), dtype=getattr(torch, dtype), attn_implementation="eager",
        experts_implementation="eager").eval()
    runner = ModelRunner(loaded.config, loaded.checkpoint,
                         _plan(moe_dir, loaded, dtype=dtype).runner)
    ids = np.random.default_rng(seed).integers(0, 32768, size=24)
    with torch.no_grad():
        ref = model(torch.tensor(ids)[None]).logits[0].float().numpy()
    return model, runner, ids, _prefill_logits(runner, ids), ref


def test_config_reads_the_moe_fields(loaded):
    cfg = loaded.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == (ARCH, 8, 2)
    assert (cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.decoder_sparse_step) == (32, True, 1)
    assert cfg.mlp_only_layers == ()


def test_fp32_logits_and_greedy_match_hf(moe_dir, loaded):
    model, runner, ids, ours, ref = _hf_and_ours(moe_dir, loaded, "float32", seed=1)
    assert runner.kernels.describe()["router_topk"] == "stable"
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    prompt = ids[:8]
    assert _greedy(runner, prompt, 12) == hf_greedy(model, prompt, 12)


def test_bf16_logits_close_to_hf(moe_dir, loaded):
    _, _, _, ours, ref = _hf_and_ours(moe_dir, loaded, "bfloat16", seed=2)
    assert np.abs(ref).max() < 8
    assert np.abs(ours - ref).max() <= 0.125
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.25
    assert clear.any()
    assert (ours.argmax(-1) == ref.argmax(-1))[clear].all()


def test_engine_generates_under_auto(moe_dir):
    with Engine(model_path=str(moe_dir), dtype="float32", max_total_tokens=1024,
                max_prefill_tokens=64, max_running_requests=4, skip_warmup=True,
                moe_combine_order="slot") as engine:
        outs = engine.generate(input_ids=[[11, 22, 33, 44], [5, 6, 7]],
                               sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                "ignore_eos": True})
    assert [len(o["output_ids"]) for o in outs] == [6, 6]


def test_rl_bitwise_plans_the_trainer_aligned_moe_switches(moe_dir, loaded):
    """The profile declares rl-bitwise (tests/test_moe_align.py, tests/test_expert_parallel.py), and
    the launch pins the router's torch tie order and the slot-order combine."""
    plan = _plan(moe_dir, loaded, numerics="rl-bitwise")
    assert (plan.model.moe.router_topk, plan.model.moe.combine_order) == ("torch", "slot")


def test_router_topk_torch_plans_the_torch_leaf_or_refuses(moe_dir, loaded):
    plan = _plan(moe_dir, loaded, router_topk="torch")
    assert plan.model.moe.router_topk == "torch"
    if any(leaf.impl == "torch" for leaf in REGISTRY.leaves("moe", "router_topk")):
        kernels = ModelKernels.plan_for(dtype=jnp.float32, hardware="cpu", moe=plan.model.moe)
        assert kernels.router_topk.leaf.impl == "torch"
    else:
        with pytest.raises(KernelPlanError, match="--router-topk torch.*not the requested"):
            ModelKernels.plan_for(dtype=jnp.float32, hardware="cpu", moe=plan.model.moe)


def test_unbuilt_or_inert_moe_switches_are_refused(moe_dir, loaded):
    """EPLB needs expert parallelism (tests/test_eplb.py); no expert backend is built."""
    with pytest.raises(LaunchRefusal, match=r"--enable-eplb True has no effect.*\(--ep-size > 1\)"):
        _plan(moe_dir, loaded, enable_eplb=True)


def test_moe_backend_selects_the_expert_path(moe_dir, loaded):
    """--moe-backend: auto is the einsum path (portable) when nothing requires batch invariance and
    the per-expert GEMM plans (batch_invariant) under rl-bitwise; the two agree within f32 rounding
    (1e-4). Whether their bits differ depends on the CPU's dot kernels (some in an AVX-512 run, none
    on an AVX2 machine), so it is not asserted: the plans above show the switch acts."""
    def runner(**launch):
        return ModelRunner(loaded.config, loaded.checkpoint,
                           _plan(moe_dir, loaded, dtype="float32", **launch).runner)

    auto, explicit = runner(), runner(moe_backend="batch_invariant")
    assert auto.kernels.describe()["expert_backend"] == "portable"
    assert explicit.kernels.describe()["expert_backend"] == "batch_invariant"
    assert runner(numerics="rl-bitwise").kernels.describe()["expert_backend"] == "batch_invariant"
    ids = np.random.default_rng(4).integers(0, 32768, size=20)
    a, b = _prefill_logits(auto, ids), _prefill_logits(explicit, ids)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def _row_count_gemm(x, w, bias=None, *, out_dtype):
    """The control: a GEMM that switches tactic with the row count (above 16 rows, two K halves
    each rounded to bf16, as a vendor GEMM's reduced-precision split-K), as XLA's dot does on the
    GPU; on the CPU, under the test session's flags, XLA's dot happens to be row-invariant here."""
    if x.shape[0] <= 16:
        return sequential_dot(x, w, bias).astype(out_dtype)
    k = x.shape[1] // 2
    acc = (sequential_dot(x[:, :k], w[:k]).astype(jnp.bfloat16).astype(jnp.float32)
           + sequential_dot(x[:, k:], w[k:]).astype(jnp.bfloat16).astype(jnp.float32))
    return (acc if bias is None else acc + bias.astype(jnp.float32)).astype(out_dtype)


def _swap_leaf(plan, fn):
    """The kernel plan with its leaf's function replaced."""
    return dataclasses.replace(plan, leaf=dataclasses.replace(plan.leaf, fn=fn))


def _with_gemm(kernels, gemm):
    def group(x, ws, biases=None, *, out_dtype):
        return tuple(gemm(x, w, out_dtype=out_dtype) for w in ws)

    return dataclasses.replace(kernels, gemm=_swap_leaf(kernels.gemm, gemm),
                               gemm_group=_swap_leaf(kernels.gemm_group, group))


def _rows_alone_vs_batched(cfg, kernels):
    """How many output elements of an 18-row MoE block call differ from each row run alone."""
    block = SparseMoE(cfg, SparseMoE.specs(cfg, dtype=jnp.bfloat16), RandomSource(0))
    run = jax.jit(lambda x: block(kernels, x, dtype=jnp.bfloat16))
    x = jax.random.normal(jax.random.key(1), (18, cfg.hidden_size)).astype(jnp.bfloat16)
    batched = np.asarray(run(x)).view(np.uint16)
    alone = np.stack([np.asarray(run(x[i:i + 1]))[0].view(np.uint16) for i in range(18)])
    return int((batched != alone).sum())


def test_moe_block_rows_are_batch_invariant(loaded):
    """Under the stable router and fixed-order GEMMs a row's output bits do not depend on the
    17 other rows; a GEMM that changes tactic with the row count (the control) moves them."""
    kernels = ModelKernels.plan_for(dtype=jnp.bfloat16, hardware="cpu",
                                    features=frozenset({"batch_invariant"}))
    assert (kernels.gemm.leaf.impl, kernels.router_topk.leaf.impl) == ("fixed_order", "stable")
    assert _rows_alone_vs_batched(loaded.config, kernels) == 0
    assert _rows_alone_vs_batched(loaded.config, _with_gemm(kernels, _row_count_gemm)) > 0


def _tile_counting(kernels, counts: list):
    """The kernel set with its grouped GEMM wrapped to record each call's (rows, tile experts)."""
    fn = kernels.grouped_gemm.leaf.fn

    def counted(x, w, tile_expert, **kw):
        counts.append((x.shape[0], tile_expert))
        return fn(x, w, tile_expert, **kw)

    return dataclasses.replace(kernels, grouped_gemm=_swap_leaf(kernels.grouped_gemm, counted))


def test_padding_rows_reach_no_expert(loaded):
    """A step bucket's padding rows (`padding`, from the null page in the dense body) are routed
    to no expert: the real rows keep every bit, the padding rows come out zero, and the grouped
    GEMMs run only the real rows' experts' tiles, in the static layout `layout_rows` counts. The
    control: without the mask the same rows (all alike, as a bucket's padding is) add their own
    experts' tiles."""
    cfg = loaded.config
    kernels = ModelKernels.plan_for(dtype=jnp.bfloat16, hardware="cpu",
                                    features=frozenset({"batch_invariant"}))
    block = SparseMoE(cfg, SparseMoE.specs(cfg, dtype=jnp.bfloat16), RandomSource(0))
    real = jax.random.normal(jax.random.key(3), (2, cfg.hidden_size)).astype(jnp.bfloat16)
    pad = jax.random.normal(jax.random.key(4), (1, cfg.hidden_size)).astype(jnp.bfloat16)
    x = jnp.concatenate([real, jnp.repeat(pad, 14, axis=0)])                  # 16 rows, 14 padding
    padding = jnp.arange(16) >= 2
    tiles = {}
    outs = {}
    for name, mask in (("masked", padding), ("unmasked", None)):
        counts = []
        outs[name], ids = block.routed(_tile_counting(kernels, counts), x, dtype=jnp.bfloat16,
                                       padding=mask)
        tiles[name] = {int((np.asarray(t) >= 0).sum()) for _, t in counts}
        if mask is not None:
            assert {rows for rows, _ in counts} == {layout_rows(
                16, cfg.num_experts_per_tok, cfg.num_experts, cfg.moe_intermediate_size,
                cfg.hidden_size, jnp.bfloat16)}
    real_experts = len(set(np.asarray(ids[:2]).ravel().tolist()))
    all_experts = len(set(np.asarray(ids).ravel().tolist()))
    assert all_experts > real_experts, "the control needs padding routed to other experts"
    masked, unmasked = (np.asarray(outs[n]).view(np.uint16) for n in ("masked", "unmasked"))
    assert np.array_equal(masked[:2], unmasked[:2])
    assert not masked[2:].any() and unmasked[2:].any()
    assert tiles == {"masked": {real_experts}, "unmasked": {all_experts}}


def _reference_block(block, kernels, x, *, weight_inside: bool):
    """Each token's k experts one by one with the block's own leaves: the weight applied to the
    activation before down_proj (the spec's slot form), or to down_proj's output (HF eager's)."""
    ids, weights = block.route(kernels, x, dtype=jnp.bfloat16)
    gate, up, down = (getattr(block.experts, n)[...] for n in ("gate_proj", "up_proj", "down_proj"))
    rows = []
    for t in range(x.shape[0]):
        acc = None
        for s in range(ids.shape[1]):
            e, w = int(ids[t, s]), weights[t, s]
            xt = x[t:t + 1]
            a = (kernels.silu(kernels.gemm(xt, gate[e], None, out_dtype=jnp.bfloat16))
                 * kernels.gemm(xt, up[e], None, out_dtype=jnp.bfloat16))
            y = (kernels.gemm(a * w, down[e], None, out_dtype=jnp.bfloat16) if weight_inside
                 else kernels.gemm(a, down[e], None, out_dtype=jnp.bfloat16) * w)
            acc = y.astype(jnp.float32) if acc is None else acc + y.astype(jnp.float32)
        rows.append(acc.astype(jnp.bfloat16))
    return np.asarray(jnp.concatenate(rows)).view(np.uint16)


def test_routing_weight_scales_inside_the_activation(loaded):
    """The block's bits are the spec's slot form: each slot's activation times its routing weight
    before down_proj, the k outputs folded in f32 in slot order. Scaling after down_proj (HF eager's
    rounding point) is the control: it moves bits."""
    kernels = ModelKernels.plan_for(dtype=jnp.bfloat16, hardware="cpu",
                                    features=frozenset({"batch_invariant"}))
    block = SparseMoE(loaded.config, SparseMoE.specs(loaded.config, dtype=jnp.bfloat16),
                      RandomSource(0))
    x = jax.random.normal(jax.random.key(2), (6, loaded.config.hidden_size)).astype(jnp.bfloat16)
    got = np.asarray(block(kernels, x, dtype=jnp.bfloat16)).view(np.uint16)
    assert np.array_equal(got, _reference_block(block, kernels, x, weight_inside=True))
    assert not np.array_equal(got, _reference_block(block, kernels, x, weight_inside=False))
