"""The experimental fused leaves (pallas_kernels/gemm_epilogues.py): JENGINE_GEMM_EPILOGUES, how a
model plans them (only as the composition of exactly its separate leaves), and the dense body's
fused path -- o_proj / down_proj left to the boundary after them, gate/up with SwiGLU -- which must
give the goldens' bits (tests/goldens/cpu.json), with a control showing the path is taken and a
wrong leaf on it is caught.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

import pallas_kernels  # noqa: F401  (registers the leaves)
from jengine.models.dense import ModelKernels
from pallas_kernels import gemm_epilogues
from pallas_kernels.gemm import gemm_fixed_order
from pallas_kernels.registry import REGISTRY, Priority
from pallas_kernels.rmsnorm import add_rmsnorm
from tests.triton_interpreter import registered_as_on_a_gpu, triton_gemm_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import goldens  # noqa: E402

GOLDEN = json.loads((ROOT / "tests" / "goldens" / "cpu.json").read_text())
INVARIANT = frozenset({"batch_invariant"})


def _plan(hardware="cpu", features=INVARIANT):
    return ModelKernels.plan_for(dtype=jnp.bfloat16, hardware=hardware, features=features)


@pytest.mark.parametrize("value, want", [(None, set()), ("", set()), ("swiglu", {"swiglu"}),
                                         (" add_norm , swiglu ", {"add_norm", "swiglu"})])
def test_requested_reads_the_variable(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(gemm_epilogues.ENV, raising=False)
    else:
        monkeypatch.setenv(gemm_epilogues.ENV, value)
    assert gemm_epilogues.requested() == want


def test_an_unknown_epilogue_is_refused_naming_the_variable_and_value(monkeypatch):
    monkeypatch.setenv(gemm_epilogues.ENV, "add_norm,add_silu")
    with pytest.raises(ValueError, match=r"JENGINE_GEMM_EPILOGUES='add_norm,add_silu': unknown "
                                         r"\['add_silu'\]"):
        _plan()


def test_planned_only_on_request_and_only_over_its_own_leaves(monkeypatch):
    """Off by default. On request, rl-bitwise's portable plans get the portable fused leaves;
    auto's XLA leaves have no fused form, so nothing is planned (and nothing refused)."""
    monkeypatch.delenv(gemm_epilogues.ENV, raising=False)
    off = _plan()
    assert (off.gemm_add_rmsnorm, off.gemm_swiglu) == (None, None)
    monkeypatch.setenv(gemm_epilogues.ENV, "add_norm,swiglu")
    on = _plan()
    assert on.describe()["gemm_add_rmsnorm"] == on.describe()["gemm_swiglu"] == "fixed_order"
    assert {k: v for k, v in on.describe().items() if not k.startswith("gemm_")} == \
        {k: v for k, v in off.describe().items() if not k.startswith("gemm_")}
    auto = _plan(features=frozenset())
    assert auto.gemm.leaf.impl == "xla_native"
    assert (auto.gemm_add_rmsnorm, auto.gemm_swiglu) == (None, None)


def test_a_fused_leaf_silent_on_what_it_composes_is_never_planned(monkeypatch):
    """A leaf ranked above the portable one but declaring no `composes` feature (only
    batch_invariant) is not eligible: the plan keeps the leaf that composes the planned ones.
    Control: the same stand-in declaring the feature is planned."""
    standin = gemm_epilogues.gemm_add_rmsnorm_fixed_order
    common = dict(formats={"bf16", "f32"}, hardware={"any"}, priority=Priority.VENDOR)
    monkeypatch.setenv(gemm_epilogues.ENV, "add_norm")
    REGISTRY.register("linear", "gemm_add_rmsnorm", "standin_silent", **common,
                      features={"batch_invariant"})(standin)
    try:
        assert _plan().gemm_add_rmsnorm.leaf.impl == "fixed_order"
    finally:
        REGISTRY.unregister("linear", "gemm_add_rmsnorm", "standin_silent")
    REGISTRY.register("linear", "gemm_add_rmsnorm", "standin_declared", **common, features={
        "batch_invariant", gemm_epilogues.composes(gemm="fixed_order", add_rmsnorm="fixed_order")})(
        standin)
    try:
        assert _plan().gemm_add_rmsnorm.leaf.impl == "standin_declared"
    finally:
        REGISTRY.unregister("linear", "gemm_add_rmsnorm", "standin_declared")


@pytest.fixture
def triton_gemm_and_epilogues_on_a_gpu(monkeypatch):
    """The Triton GEMM, SiLU and the two fused leaves registered as on a GPU (not the norm)."""
    from pallas_kernels import (triton_activation, triton_gemm, triton_gemm_add_norm,
                                triton_gemm_swiglu)

    gens = [registered_as_on_a_gpu(monkeypatch, triton_gemm, triton_gemm_leaves()),
            registered_as_on_a_gpu(monkeypatch, triton_activation,
                                   [("activation", "silu", "triton_elementwise")]),
            registered_as_on_a_gpu(monkeypatch, triton_gemm_add_norm,
                                   [("linear", "gemm_add_rmsnorm", "triton_fixed_tile")]),
            registered_as_on_a_gpu(monkeypatch, triton_gemm_swiglu,
                                   [("linear", "gemm_swiglu", "triton_fixed_tile")])]
    for gen in gens:
        next(gen)
    yield
    for gen in reversed(gens):
        next(gen, None)


def test_on_a_gpu_each_fused_leaf_needs_exactly_the_leaves_it_composes(
        monkeypatch, triton_gemm_and_epilogues_on_a_gpu):
    """With the Triton GEMM and SiLU but no Triton norm, gemm_swiglu composes the planned leaves
    (triton_fixed_tile + triton_elementwise) and is planned; gemm_add_rmsnorm's Triton leaf
    composes triton_fixed_tree, not the planned fixed_order norm, so it is not (and the portable
    one composes another GEMM)."""
    monkeypatch.setenv(gemm_epilogues.ENV, "add_norm,swiglu")
    kern = _plan(hardware="gpu")
    assert (kern.gemm.leaf.impl, kern.add_rmsnorm.leaf.impl) == ("triton_fixed_tile", "fixed_order")
    assert kern.gemm_swiglu.leaf.impl == "triton_fixed_tile"
    assert kern.gemm_add_rmsnorm is None


def test_the_triton_leaf_takes_one_launch_at_the_fewest_decode_rows_only():
    """gemm_add_rmsnorm's GPU leaf makes its one launch on the table's fused-reduce decode tiles
    (the 8B o_proj / down_proj) under the rounded sum, up to ONE_LAUNCH_MAX_M rows (its last
    program norms them one by one); elsewhere the two launches."""
    from pallas_kernels.triton_gemm_add_norm import ONE_LAUNCH_MAX_M, one_launch

    def case(m, k, round_sum=True):
        x = jnp.zeros((m, k), jnp.bfloat16)
        return one_launch(x, jnp.zeros((k, 4096), jnp.bfloat16), None, round_sum)

    few = range(1, ONE_LAUNCH_MAX_M + 1)
    assert [case(m, 4096) for m in few] == [case(m, 14336) for m in few] == [True] * len(few)
    assert [case(ONE_LAUNCH_MAX_M + 1, 4096), case(64, 14336), case(65, 4096), case(4096, 4096),
            case(1, 4096, round_sum=False), case(0, 4096)] == [False] * 6


def test_the_fused_path_keeps_every_golden_bit(monkeypatch):
    """Every dense family's engine (tests/goldens/cpu.json, families) with both fused leaves
    planned: o_proj and down_proj run with their boundary's add + norm, gate/up with the SiLU."""
    monkeypatch.setenv(gemm_epilogues.ENV, "add_norm,swiglu")
    got = goldens.compute(["families"], trainer=False, device="cpu")["families"]
    want = {k: {f: v for f, v in case.items() if f != "trainer_dump"}
            for k, case in GOLDEN["families"].items()}
    assert goldens.differences(want, got, "families") == []


def test_control_the_fused_path_is_taken_and_a_wrong_leaf_on_it_is_caught(monkeypatch):
    """Stand-ins that declare the portable leaves' compositions, ranked above them: a
    gemm_add_rmsnorm that reads the f32 sum where the unfused boundary reads the rounded one,
    and a gemm_swiglu that counts its calls. The first must move bits of the tiny section; the
    second must have been called (so the equality above is not the separate leaves')."""
    calls = []

    def wrong_add_norm(x, w, bias, residual, norm_weight, *, eps, round_sum=False):
        h = gemm_fixed_order(x, w, bias, out_dtype=residual.dtype)
        return add_rmsnorm(h, residual, norm_weight, eps=eps, round_sum=not round_sum)

    def counted_swiglu(x, w_gate, w_up, *, out_dtype):
        calls.append(x.shape)
        return gemm_epilogues.gemm_swiglu_fixed_order(x, w_gate, w_up, out_dtype=out_dtype)

    common = dict(formats={"bf16", "f32"}, hardware={"any"}, priority=Priority.VENDOR)
    REGISTRY.register("linear", "gemm_add_rmsnorm", "standin_wrong", **common, features={
        "batch_invariant", gemm_epilogues.composes(gemm="fixed_order", add_rmsnorm="fixed_order")})(
        wrong_add_norm)
    REGISTRY.register("linear", "gemm_swiglu", "standin_counted", **common, features={
        "batch_invariant", gemm_epilogues.composes(gemm_group="fixed_order", silu="elementwise")})(
        counted_swiglu)
    try:
        monkeypatch.setenv(gemm_epilogues.ENV, "add_norm,swiglu")
        got = goldens.compute(["tiny"], trainer=False, device="cpu")["tiny"]
    finally:
        REGISTRY.unregister("linear", "gemm_add_rmsnorm", "standin_wrong")
        REGISTRY.unregister("linear", "gemm_swiglu", "standin_counted")
    assert goldens.differences(GOLDEN["tiny"], got, "tiny") != []
    assert calls, "the model never called gemm_swiglu"
