"""The invariance harness: it passes bitwise under rl-bitwise and it can fail.

The full harness (alone / packed / rerun / chunked prefill 4, 7, 256 / prefix hit at an odd position
off a page boundary / forced retraction +3 and -3, greedy and T=1) runs against the embedded tiny
model. Two negative controls show the checker is not vacuous: the comparator flags a planted
one-bit change, a -0.0 vs +0.0 and a NaN; and the whole harness, run on an engine whose GEMM leaf
changes its reduction with the row count while declaring batch invariance, reports divergences.
"""

import math

import pytest

from jengine.invariance import (DEFAULT_PROMPTS, HarnessConfig, InvarianceHarness, ModeResult,
                                Record, compare, prefix_cut)


def _flip_last_bit(x: float) -> float:
    import struct

    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return struct.unpack("<f", struct.pack("<I", bits ^ 1))[0]


@pytest.mark.parametrize("mutate,what", [
    (lambda r: r.output_logprobs.__setitem__(1, _flip_last_bit(r.output_logprobs[1])), "output logprob"),
    (lambda r: r.output_logprobs.__setitem__(0, 0.0), "output logprob"),  # -0.0 -> +0.0
    (lambda r: r.input_logprobs.__setitem__(2, math.nan), "prompt logprob"),
    (lambda r: r.output_ids.__setitem__(2, r.output_ids[2] + 1), "output token"),
])
def test_comparator_catches_planted_differences(mutate, what):
    want = Record(output_ids=[5, 6, 7], output_logprobs=[-0.0, -1.25, -3.5],
                  input_logprobs=[None, -2.0, -4.0])
    got = Record(output_ids=list(want.output_ids), output_logprobs=list(want.output_logprobs),
                 input_logprobs=list(want.input_logprobs))
    result = ModeResult("unit", 0.0, 1)
    compare("unit", 0.0, 0, want, got, result)
    assert result.divergences == []
    mutate(got)
    compare("unit", 0.0, 0, want, got, result)
    assert len(result.divergences) == 1 and result.divergences[0].what == what


@pytest.mark.parametrize("length,page_size,cut", [
    (12, 4, 9),    # length - 2 = 10 is even: one further back
    (11, 4, 9),    # length - 2 = 9 is odd and not a whole page
    (7, 4, 5), (3, 4, 1), (2, 4, 1),
    (1, 4, 0), (0, 4, 0),   # nothing to cache before the last token: scored cold
    (17, 3, 13),   # 15 is odd but 5 whole pages of 3
    (20, 1, 17),   # page size 1: every count is whole pages; the largest odd one
])
def test_prefix_cut_is_odd_and_off_a_page_boundary(length, page_size, cut):
    assert prefix_cut(length, page_size) == cut


def _run(numerics):
    cfg = HarnessConfig(numerics=numerics, prompts=DEFAULT_PROMPTS[:5], max_new_tokens=8)
    lines = []
    return InvarianceHarness(cfg).run(report=lines.append), lines[0]


def test_rl_bitwise_passes_every_mode_bitwise():
    results, table = _run("rl-bitwise")
    print(table)
    modes = {r.mode for r in results}
    assert {"packed", "rerun", "prefix-hit", "chunk-4", "chunk-7", "chunk-256", "retract+3",
            "retract-3", "overlap-off"} <= modes
    assert {r.temperature for r in results} == {0.0, 1.0}
    assert all(r.compared_values > 0 for r in results)
    diverged = [str(d) for r in results for d in r.divergences]
    assert diverged == [], "\n".join(diverged)
    # The hits really resumed at odd positions inside a page (page size 4), and the table says so.
    cuts = [c for r in results if r.mode == "prefix-hit" for c in r.prefix_cuts]
    assert len(cuts) == 10 and all(c % 2 == 1 and c % 4 for c in cuts), cuts
    assert "cached prefixes: [" in table


@pytest.fixture
def lying_gemm_leaf():
    """A GEMM that switches its reduction by row count, as cuBLAS/XLA pick tactics, while DECLARING
    the batch_invariant feature. rl-bitwise plans it (VENDOR band); the harness must catch it."""
    import jax.numpy as jnp

    from pallas_kernels.fixed_order import sequential_dot
    from pallas_kernels.registry import REGISTRY, Priority

    @REGISTRY.register("linear", "gemm", "test_lying_leaf", formats={"bf16", "f32"},
                       hardware={"any"}, priority=Priority.VENDOR, features={"batch_invariant"})
    def lying_gemm(x, w, bias=None, *, out_dtype):
        if x.shape[0] <= 16:
            return sequential_dot(x, w, bias).astype(out_dtype)
        # A static, shape-based "tactic" switch to a reduced-precision (bf16) accumulation, like
        # cuBLAS's allow_bf16_reduced_precision_reduction: large enough to survive bf16 outputs.
        k = x.shape[1] // 2
        first = sequential_dot(x[:, :k], w[:k]).astype(jnp.bfloat16)
        second = sequential_dot(x[:, k:], w[k:]).astype(jnp.bfloat16)
        acc = first.astype(jnp.float32) + second.astype(jnp.float32)
        if bias is not None:
            acc = acc + bias.astype(jnp.float32)
        return acc.astype(out_dtype)

    yield
    REGISTRY.unregister("linear", "gemm", "test_lying_leaf")


def test_negative_control_harness_catches_a_batch_variant_leaf(lying_gemm_leaf):
    # On the CPU, XLA's own dot happens to be row-invariant at the engine's padded buckets (>= 16
    # rows), so `--numerics auto` passes here; on the H200 it does not (docs/gpu-validation.md).
    # The control therefore plants a leaf that changes its reduction order with the row count.
    cfg = HarnessConfig(numerics="rl-bitwise", prompts=DEFAULT_PROMPTS[:3], max_new_tokens=4,
                        temperatures=(0.0,), chunk_sizes=(7,), retraction_intervals=())
    lines = []
    results = InvarianceHarness(cfg).run(report=lines.append)
    print(lines[0])
    assert any(r.divergences for r in results if r.mode in ("packed", "chunk-7"))


@pytest.mark.parametrize("architecture", [
    # CI time: both slow-only; in CI the harness runs on tiny's Qwen3 (above) and every family is
    # teacher-forced against its trainer dump (tests/test_interop_align.py)
    pytest.param("LlamaForCausalLM", marks=pytest.mark.slow),
    pytest.param("Qwen2ForCausalLM", marks=pytest.mark.slow)])
def test_rl_bitwise_other_dense_families(tmp_path, architecture):
    """The declared families beyond tiny's Qwen3, on tiny random checkpoints (vocab 32768): every
    mode at T=0 and T=1, with one chunk size and one retraction interval to keep CI short."""
    pytest.importorskip("transformers")
    from interop.testing import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path / architecture, architecture)
    cfg = HarnessConfig(model=str(path), numerics="rl-bitwise", prompts=DEFAULT_PROMPTS[:3],
                        max_new_tokens=6, chunk_sizes=(7,), retraction_intervals=(-3,))
    lines = []
    results = InvarianceHarness(cfg).run(report=lines.append)
    print(lines[0])
    assert {r.mode for r in results} == {"packed", "rerun", "prefix-hit", "chunk-7", "retract-3",
                                         "overlap-off"}
    diverged = [str(d) for r in results for d in r.divergences]
    assert diverged == [], "\n".join(diverged)
