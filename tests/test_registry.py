"""The kernel registry: traits vs features, priority bands, frozen plans, exclusion reports.

Every test uses its own Registry(), so nothing leaks into the leaves the models plan from.
"""

from __future__ import annotations

import pytest

from pallas_kernels.registry import KernelPlanError, Priority, Registry


def leaf(reg, impl, *, family="linear", name="gemm", formats=("bf16",), hardware=("any",), **kw):
    """Register a leaf that returns its own impl name, so a plan's choice is observable by calling it."""
    reg.register(family, name, impl, formats=formats, hardware=hardware, **kw)(lambda *a, **k: impl)


def chosen(reg, family="linear", name="gemm", *, formats=("bf16",), hardware="cpu", **kw) -> str:
    return reg.plan(family, name, formats=formats, hardware=hardware, **kw)()


@pytest.fixture
def reg():
    return Registry()


def test_a_requested_trait_excludes_only_leaves_declaring_the_opposite(reg):
    leaf(reg, "silent", priority=Priority.TUNED)
    leaf(reg, "claims", priority=Priority.PORTABLE, traits={"batch_invariant": True})
    leaf(reg, "denies", priority=Priority.VENDOR, traits={"batch_invariant": False})
    # The silent leaf stays eligible and wins on priority: a trait is no guarantee.
    assert chosen(reg, traits={"batch_invariant": True}) == "silent"
    assert chosen(reg) == "denies"  # negative control: without the request the denier wins


def test_a_required_feature_admits_only_leaves_declaring_it(reg):
    leaf(reg, "silent", priority=Priority.VENDOR)
    leaf(reg, "claims_trait", priority=Priority.VENDOR, traits={"batch_invariant": True})
    leaf(reg, "declares", priority=Priority.PORTABLE, features={"batch_invariant"})
    assert chosen(reg, features={"batch_invariant"}) == "declares"
    assert chosen(reg) == "claims_trait"  # without the feature the higher band wins (name tie-break)


def test_features_are_a_subset_test(reg):
    leaf(reg, "one", features={"batch_invariant"})
    leaf(reg, "both", features={"batch_invariant", "cuda_graph"})
    assert chosen(reg, features={"batch_invariant", "cuda_graph"}) == "both"


def test_a_trait_may_declare_the_set_of_values_a_leaf_supports(reg):
    leaf(reg, "rank_only", family="moe", name="apply", priority=Priority.VENDOR,
         traits={"combine_order": {"rank"}})
    leaf(reg, "both_orders", family="moe", name="apply", traits={"combine_order": {"rank", "slot"}})
    assert chosen(reg, "moe", "apply", traits={"combine_order": "slot"}) == "both_orders"
    assert chosen(reg, "moe", "apply", traits={"combine_order": "rank"}) == "rank_only"


def test_priority_bands_then_the_name_breaks_ties(reg):
    leaf(reg, "zeta", priority=Priority.PORTABLE)
    leaf(reg, "beta", priority=Priority.TUNED)
    leaf(reg, "alpha", priority=Priority.TUNED)  # registered after beta, still wins the tie
    assert chosen(reg) == "alpha"
    leaf(reg, "vendor", priority=Priority.VENDOR)
    assert chosen(reg) == "vendor"
    assert Priority.PORTABLE < Priority.TUNED < Priority.VENDOR


def test_a_plan_is_frozen_at_construction(reg):
    leaf(reg, "first")
    frozen = reg.plan("linear", "gemm", formats={"bf16"}, hardware="cpu")
    reg.register("linear", "gemm", "first", formats={"bf16"}, hardware={"any"})(lambda: "replaced")
    leaf(reg, "better", priority=Priority.VENDOR)
    reg.unregister("linear", "gemm", "first")
    assert frozen() == "first" and frozen.leaf.impl == "first"  # no re-selection, no fallback
    assert chosen(reg) == "better"  # a new plan sees the new registry
    with pytest.raises(Exception):
        frozen.leaf = None  # the plan itself cannot be re-pointed


def test_a_missing_feature_fails_naming_every_exclusion(reg):
    leaf(reg, "fast", priority=Priority.TUNED, traits={"batch_invariant": False})
    leaf(reg, "gpu_only", hardware=("gpu",), features={"batch_invariant"})
    leaf(reg, "f32_only", formats=("f32",), features={"batch_invariant"})
    with pytest.raises(KernelPlanError) as info:
        reg.plan("linear", "gemm", formats={"bf16"}, hardware="cpu", features={"batch_invariant"})
    msg = str(info.value)
    assert "linear.gemm" in msg and "required features ['batch_invariant']" in msg
    assert "fast: does not declare required features ['batch_invariant']" in msg
    assert "gpu_only: hardware ['gpu'] does not include cpu" in msg
    assert "f32_only: formats ['f32'] lack ['bf16']" in msg


def test_no_leaf_at_all_is_a_plan_error(reg):
    with pytest.raises(KernelPlanError, match="no leaf is registered for linear.gemm"):
        reg.plan("linear", "gemm", hardware="cpu")


def test_a_leaf_constraining_a_variable_dimension_is_excluded(reg):
    leaf(reg, "row_bucketed", priority=Priority.VENDOR, features={"batch_invariant"},
         constrains_variable_dims=True)
    leaf(reg, "any_rows", features={"batch_invariant"})
    assert chosen(reg, features={"batch_invariant"}) == "any_rows"
    reg.unregister("linear", "gemm", "any_rows")
    with pytest.raises(KernelPlanError, match="row_bucketed: constrains a variable dimension"):
        reg.plan("linear", "gemm", formats={"bf16"}, hardware="cpu")


def test_static_geometry_constraints(reg):
    whole_blocks = {"vocab_size": lambda v: v % 32768 == 0}
    leaf(reg, "blocked", family="sampling", name="block_sumexp", priority=Priority.VENDOR,
         constraints=whole_blocks)
    leaf(reg, "general", family="sampling", name="block_sumexp")
    assert chosen(reg, "sampling", "block_sumexp", geometry={"vocab_size": 65536}) == "blocked"
    assert chosen(reg, "sampling", "block_sumexp", geometry={"vocab_size": 32000}) == "general"
    # A constraint the plan cannot evaluate is not a pass.
    assert chosen(reg, "sampling", "block_sumexp") == "general"
    reg.unregister("sampling", "block_sumexp", "general")
    with pytest.raises(KernelPlanError) as info:
        reg.plan("sampling", "block_sumexp", formats={"bf16"}, hardware="cpu",
                 geometry={"vocab_size": 32000})
    assert "blocked: rejects vocab_size=32000" in str(info.value)
    with pytest.raises(KernelPlanError, match="constrains vocab_size but the plan's geometry"):
        reg.plan("sampling", "block_sumexp", formats={"bf16"}, hardware="cpu")


def test_hardware_matching(reg):
    leaf(reg, "portable", hardware=("any",))
    leaf(reg, "gpu", hardware=("gpu",), priority=Priority.TUNED)
    leaf(reg, "hopper", hardware=("gpu-sm90",), priority=Priority.VENDOR)
    assert chosen(reg, hardware="cpu") == "portable"
    assert chosen(reg, hardware="gpu") == "gpu"  # an sm90 leaf does not serve any GPU
    assert chosen(reg, hardware="gpu-sm90") == "hopper"
    reg.unregister("linear", "gemm", "hopper")
    assert chosen(reg, hardware="gpu-sm90") == "gpu"  # a plain GPU leaf serves sm90
    with pytest.raises(ValueError, match="unknown hardware"):
        leaf(reg, "bad", hardware=("cuda",))


def test_an_explicit_implementation_does_not_bypass_the_capability_check(reg):
    leaf(reg, "fast", priority=Priority.TUNED)
    leaf(reg, "invariant", features={"batch_invariant"})
    assert chosen(reg, impl="fast") == "fast"
    with pytest.raises(KernelPlanError, match="fast: does not declare required features"):
        reg.plan("linear", "gemm", formats={"bf16"}, hardware="cpu", impl="fast",
                 features={"batch_invariant"})


def test_the_plan_records_what_it_was_planned_for(reg):
    leaf(reg, "invariant", features={"batch_invariant"})
    p = reg.plan("linear", "gemm", formats={"bf16"}, hardware="cpu", features={"batch_invariant"})
    assert (p.family, p.name, p.hardware, p.required_features) == (
        "linear", "gemm", "cpu", frozenset({"batch_invariant"}))
    assert "linear.gemm -> invariant" in p.describe()


def test_the_model_plans_attention_with_its_head_dim():
    """A leaf constraining head_dim (the Triton attention on a GPU) serves only the head dims it
    takes; for the others the model plans the next leaf at construction (here, on the global
    registry, with a stand-in for the Triton leaf registered for the CPU and removed after)."""
    import jax.numpy as jnp

    from jengine.models.dense import ModelKernels
    from pallas_kernels import triton_attention
    from pallas_kernels.registry import REGISTRY

    REGISTRY.register("attention", "paged", "standin_pow2_only", formats={"bf16"}, hardware={"cpu"},
                      priority=Priority.VENDOR, features={"batch_invariant"},
                      constraints={"head_dim": triton_attention.head_dim_supported})(lambda: None)
    try:
        plan = lambda d: ModelKernels.plan_for(dtype=jnp.bfloat16, hardware="cpu",  # noqa: E731
                                               features={"batch_invariant"}, head_dim=d)
        assert plan(128).attention.leaf.impl == "standin_pow2_only"
        assert plan(96).attention.leaf.impl == "fixed_order"
        assert plan(8).attention.leaf.impl == "fixed_order"
    finally:
        REGISTRY.unregister("attention", "paged", "standin_pow2_only")
