"""The kernel registry: declared family signatures, traits vs features, priority bands, frozen
plans, exclusion reports, and the grouped GEMM family's bits.

Every test but the last ones uses its own Registry(), so nothing leaks into the leaves the models
plan from.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.registry import KernelPlanError, KernelRegistrationError, Priority, Registry
from tests.bits import count_bit_differences

FAMILIES = (("linear", "gemm"), ("moe", "apply"), ("sampling", "block_sumexp"))


def _operator(x):
    """x -> the leaf's own impl name (a test family)."""


def leaf(reg, impl, *, family="linear", name="gemm", formats=("bf16",), hardware=("any",), **kw):
    """Register a leaf that returns its own impl name, so a plan's choice is observable by calling it."""

    def fn(x):
        return impl

    reg.register(family, name, impl, formats=formats, hardware=hardware, **kw)(fn)


def chosen(reg, family="linear", name="gemm", *, formats=("bf16",), hardware="cpu", **kw) -> str:
    return reg.plan(family, name, formats=formats, hardware=hardware, **kw)(None)


@pytest.fixture
def reg():
    reg = Registry()
    for family, name in FAMILIES:
        reg.declare_family(family, name, _operator)
    return reg


# -- families: one declared signature, checked at registration and at every call -------------------


def _gemm_signature(x, w, bias=None, *, out_dtype):
    """x[M, K], w[K, N], bias[N] | None -> [M, N] (a test family)."""


@pytest.fixture
def gemm_reg():
    reg = Registry()
    reg.declare_family("linear", "gemm", _gemm_signature)
    return reg


def test_a_leaf_of_an_undeclared_family_is_refused(gemm_reg):
    with pytest.raises(KernelRegistrationError, match=r"family linear\.gemv is not declared "
                                                      r"\(declared: linear\.gemm\)"):
        gemm_reg.register("linear", "gemv", "mine", formats={"bf16"}, hardware={"any"})(
            lambda x, w, bias=None, *, out_dtype: x)


@pytest.mark.parametrize("fn, why", [
    (lambda x, weight, bias=None, *, out_dtype: x, "parameter 1 is 'weight'"),
    (lambda x, w, bias=None, out_dtype=None: x,
     "parameter 3 is 'out_dtype' (positional or keyword)"),
    (lambda x, w, bias, *, out_dtype: x, "parameter 'bias' has no default"),
    (lambda x, w, *, out_dtype: x, "parameter 2 is 'out_dtype'"),
    (lambda x, w, bias=None: x, "lacks parameter 'out_dtype'"),
    (lambda x, w, bias=None, *, out_dtype, tile: x, "extra parameter 'tile' must be keyword-only "
                                                     "with a default"),
    (lambda *args, **kwargs: None, "parameter 0 is 'args'"),
])
def test_a_leaf_whose_parameters_differ_from_the_family_is_refused(gemm_reg, fn, why):
    with pytest.raises(KernelRegistrationError) as info:
        gemm_reg.register("linear", "gemm", "odd", formats={"bf16"}, hardware={"any"})(fn)
    assert "leaf linear.gemm/odd" in str(info.value) and why in str(info.value), str(info.value)
    assert gemm_reg.leaves("linear", "gemm") == []


def test_a_leaf_may_add_keyword_only_knobs_with_defaults(gemm_reg):
    """What the Triton GEMM does (tile=, schedule=): callable directly, never through a plan."""

    def tuned(x, w, bias=None, *, out_dtype, tile=None, schedule=None):
        return ("tuned", tile)

    gemm_reg.register("linear", "gemm", "tuned", formats={"bf16"}, hardware={"any"})(tuned)
    p = gemm_reg.plan("linear", "gemm", formats={"bf16"}, hardware="cpu")
    assert p(1, 2, out_dtype="bf16") == ("tuned", None)
    with pytest.raises(TypeError, match="linear.gemm: got an unexpected keyword argument 'tile'"):
        p(1, 2, out_dtype="bf16", tile="mine")


def test_a_bad_call_names_the_family_and_its_signature(gemm_reg):
    gemm_reg.register("linear", "gemm", "plain", formats={"bf16"}, hardware={"any"})(
        lambda x, w, bias=None, *, out_dtype: "called")
    p = gemm_reg.plan("linear", "gemm", formats={"bf16"}, hardware="cpu")
    assert p(1, 2, out_dtype="bf16") == "called" and p(1, 2, 3, out_dtype="bf16") == "called"
    for bad in (lambda: p(1, 2), lambda: p(1, 2, None, "bf16"), lambda: p(1, out_dtype="bf16")):
        with pytest.raises(TypeError) as info:
            bad()
        msg = str(info.value)
        assert msg.startswith("linear.gemm: ") and "(x, w, bias=None, *, out_dtype)" in msg, msg


def test_a_duplicate_leaf_is_refused_naming_family_name_and_impl(gemm_reg):
    fn = lambda x, w, bias=None, *, out_dtype: "first"  # noqa: E731
    gemm_reg.register("linear", "gemm", "first", formats={"bf16"}, hardware={"any"})(fn)
    with pytest.raises(KernelRegistrationError) as info:
        gemm_reg.register("linear", "gemm", "first", formats={"f32"}, hardware={"any"})(fn)
    assert "family 'linear', name 'gemm', impl 'first'" in str(info.value)
    assert [l.formats for l in gemm_reg.leaves("linear", "gemm")] == [frozenset({"bf16"})]
    gemm_reg.unregister("linear", "gemm", "first")  # what a plugin or test does to replace one
    gemm_reg.register("linear", "gemm", "first", formats={"f32"}, hardware={"any"})(fn)
    assert [l.formats for l in gemm_reg.leaves("linear", "gemm")] == [frozenset({"f32"})]


def test_a_family_is_declared_once(gemm_reg):
    gemm_reg.declare_family("linear", "gemm", _gemm_signature)  # the same signature again: no-op

    def other(x, w, *, out_dtype):
        """x[M, K], w[K, N] -> [M, N]."""

    with pytest.raises(KernelRegistrationError, match="already declared as"):
        gemm_reg.declare_family("linear", "gemm", other)
    with pytest.raises(KernelRegistrationError, match="needs a docstring"):
        gemm_reg.declare_family("linear", "gemv", lambda x: x)
    assert gemm_reg.family("linear", "gemm").doc == "x[M, K], w[K, N], bias[N] | None -> [M, N] " \
                                                     "(a test family)."


# -- selection ------------------------------------------------------------------------------------


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
    reg.unregister("linear", "gemm", "first")
    reg.register("linear", "gemm", "first", formats={"bf16"}, hardware={"any"})(
        lambda x: "replaced")
    leaf(reg, "better", priority=Priority.VENDOR)
    reg.unregister("linear", "gemm", "first")
    assert frozen(None) == "first" and frozen.leaf.impl == "first"  # no re-selection, no fallback
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
    from pallas_kernels import attention, triton_attention
    from pallas_kernels.registry import REGISTRY

    REGISTRY.register("attention", "paged", "standin_pow2_only", formats={"bf16"}, hardware={"cpu"},
                      priority=Priority.VENDOR, features={"batch_invariant"},
                      constraints={"head_dim": triton_attention.head_dim_supported})(
        attention.paged_fixed_order)  # any function of the family's signature
    try:
        plan = lambda d: ModelKernels.plan_for(dtype=jnp.bfloat16, hardware="cpu",  # noqa: E731
                                               features={"batch_invariant"}, head_dim=d)
        assert plan(128).attention.leaf.impl == "standin_pow2_only"
        assert plan(96).attention.leaf.impl == "fixed_order"
        assert plan(8).attention.leaf.impl == "fixed_order"
    finally:
        REGISTRY.unregister("attention", "paged", "standin_pow2_only")


# -- the grouped GEMM family -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def group_operands():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 16)), jnp.bfloat16)
    ws = tuple(jnp.asarray(rng.standard_normal((16, n)), jnp.bfloat16) for n in (8, 4, 4))
    bs = tuple(jnp.asarray(rng.standard_normal(n), jnp.float32) for n in (8, 4, 4))
    return x, ws, bs


@pytest.mark.parametrize("impl", ["fixed_order", "xla_native"])
def test_each_gemm_group_output_has_its_own_gemm_calls_bits(group_operands, impl):
    from pallas_kernels.registry import plan

    x, ws, bs = group_operands
    kw = dict(formats={"bf16"}, hardware="cpu", impl=impl)
    gemm, group = plan("linear", "gemm", **kw), plan("linear", "gemm_group", **kw)
    for biases in (None, bs):
        outs = group(x, ws, biases, out_dtype=jnp.bfloat16)
        alone = [gemm(x, w, None if biases is None else biases[i], out_dtype=jnp.bfloat16)
                 for i, w in enumerate(ws)]
        assert len(outs) == 3 and [o.shape for o in outs] == [(5, 8), (5, 4), (5, 4)]
        assert [count_bit_differences(a, o) for a, o in zip(alone, outs)] == [0, 0, 0]
    # Negative control: the check sees a member's bias.
    assert count_bit_differences(group(x, ws, bs, out_dtype=jnp.bfloat16)[1],
                                 gemm(x, ws[1], out_dtype=jnp.bfloat16)) > 0


def test_gemm_and_gemm_group_leaves_correspond():
    """One request plans corresponding leaves of both families: same impls, same declarations."""
    from pallas_kernels.registry import REGISTRY, plan

    def declared(leaf):
        return (leaf.impl, leaf.formats, leaf.hardware, leaf.priority, dict(leaf.traits),
                leaf.features, leaf.constrains_variable_dims)

    gemm = sorted(map(declared, REGISTRY.leaves("linear", "gemm")), key=str)
    group = sorted(map(declared, REGISTRY.leaves("linear", "gemm_group")), key=str)
    assert gemm == group and len(gemm) >= 2
    for features in (frozenset(), frozenset({"batch_invariant"})):
        kw = dict(formats={"bf16"}, hardware="cpu", features=features)
        gemm_plan, group_plan = plan("linear", "gemm", **kw), plan("linear", "gemm_group", **kw)
        assert gemm_plan.leaf.impl == group_plan.leaf.impl
