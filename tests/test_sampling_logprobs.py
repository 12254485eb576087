"""Sampling and logprob leaves, and the Sampler: row invariance (bitwise), correctness, signed zeros.

Row invariance is checked by one helper, `invariance_failures`: every row's output bits computed
alone must equal its bits inside batches of M rows (at its own offset and at the batch's tail) and
inside a shuffled full batch. Each use of it has a negative control that the same helper catches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.engine.batch import SamplingRows
from jengine.engine.sampler import Sampler, row_bucket
from jengine.launch import SamplerOptions
from jengine.logprob_orders import LOGPROB_BLOCK_WIDTHS
from tests.bits import numpy_halving_tree, shifted_logits_and_completed
from pallas_kernels.logprobs import (
    LOGPROB_ORDERS, block_sumexp_fixed_tree, block_sumexp_xla_native, gather_token_logprobs,
    inclusive_scan_last, logprob_block_width, top_logprobs, torch_block_sumexp, tree_sum_last)
from pallas_kernels.registry import KernelPlanError, plan
from pallas_kernels.sampling import canonical_argmax, gumbel_sample

V = 32768
N = 64
MS = (1, 2, 3, 4, 7, 64)
ORDERS = tuple(LOGPROB_ORDERS)


def bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def invariance_failures(fn, inputs, ms=MS, seed=0):
    """[(case, row)] where a row's output bits in a batch differ from the row computed alone."""
    n = len(inputs[0])
    alone = [bits(fn(*(a[i:i + 1] for a in inputs)))[0] for i in range(n)]
    failures = []

    def compare(case, rows):
        out = bits(fn(*(a[rows] for a in inputs)))
        failures.extend((case, int(r)) for j, r in enumerate(rows) if not np.array_equal(out[j], alone[r]))

    for m in ms:
        compare(f"head M={m}", np.arange(m))
        compare(f"tail M={m}", np.arange(n - m, n))
    compare("shuffled", np.random.default_rng(seed).permutation(n))
    return failures


@pytest.fixture(scope="module")
def logits():
    return (np.random.default_rng(0).standard_normal((N, V)) * 3).astype(np.float32)


@pytest.fixture(scope="module")
def token_ids():
    return np.random.default_rng(1).integers(0, V, N).astype(np.int32)


@pytest.fixture(scope="module")
def invariant_plan():
    return plan("sampling", "block_sumexp", formats={"f32"}, hardware="cpu",
                features={"batch_invariant"})


@pytest.fixture(scope="module")
def sampling_rows():
    rng = np.random.default_rng(2)
    return (rng.choice([0.0, 0.7, 1.0, 1.5], N).astype(np.float32),
            rng.choice([-1, 1, 5, 50, 40000], N).astype(np.int32),
            rng.choice([1.0, 0.9, 0.5], N).astype(np.float32),
            rng.choice([0.0, 0.05], N).astype(np.float32),
            rng.integers(0, 2**32, N, dtype=np.uint64).astype(np.uint32),
            rng.integers(0, 5000, N).astype(np.int32))


def dot_block_sumexp(shifted, *, block_size):
    """Negative control: the same sums through XLA's dot, whose order changes with the row count."""
    r = shifted.shape[0]
    e = jnp.exp(shifted).reshape(r, -1, block_size)
    return e @ jnp.ones((block_size,), jnp.float32)


def numpy_logprobs(x, ids):
    x64 = x.astype(np.float64)
    m = x64.max(-1, keepdims=True)
    return x64[np.arange(len(ids)), ids] - (np.log(np.exp(x64 - m).sum(-1)) + m[:, 0])


# -- planning ----------------------------------------------------------------------------------------


def test_plans_pick_fixed_tree_under_bitwise_and_native_under_auto(invariant_plan):
    assert invariant_plan.leaf.impl == "fixed_tree"
    assert plan("sampling", "block_sumexp", formats={"f32"}, hardware="cpu").leaf.impl == "xla_native"
    with pytest.raises(KernelPlanError, match="batch_invariant"):
        plan("sampling", "block_sumexp", formats={"f32"}, hardware="cpu",
             features={"batch_invariant"}, impl="xla_native")


# -- block_sumexp ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [32768, 16384])
def test_block_sumexp_row_invariant_and_control_fails(logits, block):
    shifted = jnp.asarray(logits - logits.max(-1, keepdims=True))
    leaf = jax.jit(lambda s: block_sumexp_fixed_tree(s, block_size=block))
    assert invariance_failures(leaf, (shifted,)) == []
    control = jax.jit(lambda s: dot_block_sumexp(s, block_size=block))
    assert invariance_failures(control, (shifted,)), "dot-based control was not caught"


def test_xla_native_sum_is_caught_where_the_fixed_tree_is_not():
    """Negative control with XLA's own reduction. Measured on XLA:CPU (jax 0.10.2): jnp.sum over
    32768- or 16384-wide rows did NOT change with the row count or offset, so at V=32768 only the
    dot-based control fails; at an odd width (1001) jnp.sum does move with the batch."""
    x = (np.random.default_rng(4).standard_normal((N, 1001)) * 3).astype(np.float32)
    shifted = jnp.asarray(x - x.max(-1, keepdims=True))
    native = jax.jit(lambda s: block_sumexp_xla_native(s, block_size=1001))
    assert invariance_failures(native, (shifted,)), "XLA-native control was not caught"
    tree = jax.jit(lambda s: block_sumexp_fixed_tree(s, block_size=1001))
    assert invariance_failures(tree, (shifted,)) == []


def test_fixed_order_tree_and_scan(logits):
    x = np.abs(logits[:, :4099])  # odd width: the tree carries leftovers, the scan pads
    tree = jax.jit(tree_sum_last)
    scan = jax.jit(inclusive_scan_last)
    assert invariance_failures(tree, (x,)) == [] and invariance_failures(scan, (x,)) == []
    np.testing.assert_allclose(np.asarray(tree(x)), x.astype(np.float64).sum(-1), rtol=2e-6)
    np.testing.assert_allclose(np.asarray(scan(x)), np.cumsum(x.astype(np.float64), -1), rtol=2e-6)


def test_block_sumexp_matches_float64(logits):
    shifted = logits - logits.max(-1, keepdims=True)
    out = np.asarray(block_sumexp_fixed_tree(jnp.asarray(shifted), block_size=16384))
    ref = np.exp(shifted.astype(np.float64)).reshape(N, 2, 16384).sum(-1)
    np.testing.assert_allclose(out, ref, rtol=2e-6)


def test_torch_twin_equals_jax_leaf_bitwise(logits):
    torch = pytest.importorskip("torch")
    shifted = logits[:7] - logits[:7].max(-1, keepdims=True)
    for block in (32768, 16384):
        twin = torch_block_sumexp(torch.from_numpy(shifted), block_size=block)
        assert isinstance(twin, torch.Tensor)
        leaf = block_sumexp_fixed_tree(jnp.asarray(shifted), block_size=block)
        assert np.array_equal(bits(twin.numpy()), bits(leaf))


# -- gather_token_logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_logprobs_row_invariant_and_correct(logits, token_ids, invariant_plan, order):
    fn = jax.jit(lambda x, t: gather_token_logprobs(x, t, order, invariant_plan))
    assert invariance_failures(fn, (logits, token_ids)) == []
    # Error budget: one rounding of x - max, a 15-level fp32 tree, a log: ~1e-6 absolute here.
    np.testing.assert_allclose(np.asarray(fn(logits, token_ids)), numpy_logprobs(logits, token_ids),
                               rtol=1e-6, atol=1e-5)


def test_logprobs_control_with_dot_sums_is_caught(logits, token_ids):
    fn = jax.jit(lambda x, t: gather_token_logprobs(x, t, "blockwise", dot_block_sumexp))
    assert invariance_failures(fn, (logits, token_ids), ms=(1, 2, 4))


def test_torch_order_row_invariant_on_odd_vocab(invariant_plan):
    x = (np.random.default_rng(3).standard_normal((N, 1001)) * 3).astype(np.float32)
    t = np.arange(N, dtype=np.int32) * 13
    fn = jax.jit(lambda a, b: gather_token_logprobs(a, b, "torch", invariant_plan))
    assert invariance_failures(fn, (x, t)) == []
    np.testing.assert_allclose(np.asarray(fn(x, t)), numpy_logprobs(x, t), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("order,sign_bit", [("blockwise", 1), ("blockwise-16384", 1),
                                            ("blockwise-direct", 0), ("blockwise-direct-16384", 0),
                                            ("torch", 0)])
def test_signed_zero_for_a_certain_token(invariant_plan, order, sign_bit):
    x = np.full((2, V), -200.0, np.float32)  # exp(-200) underflows to 0 in f32: S == 1 exactly
    x[0, 5], x[1, 20000] = 0.0, 7.5
    out = gather_token_logprobs(jnp.asarray(x), jnp.array([5, 20000]), order, invariant_plan)
    assert (bits(out) == (np.uint32(sign_bit) << 31)).all(), f"{order}: {bits(out)}"


def test_unknown_orders_and_bad_vocab_are_refused(logits, token_ids, invariant_plan):
    for order in ("megatron", "Blockwise", ""):
        with pytest.raises(ValueError, match="logprob-order"):
            gather_token_logprobs(logits, token_ids, order, invariant_plan)
    for vocab in (0, -5, 3.5):
        with pytest.raises(ValueError, match=f"vocab_size={vocab}"):
            logprob_block_width("blockwise", vocab)
    assert logprob_block_width("blockwise", 49152) == 32768  # any vocabulary (last block completed)
    assert logprob_block_width("blockwise-16384", 1001) == 16384
    assert logprob_block_width("torch", 1001) == 1001


def test_trainer_forms_and_widths_name_every_blockwise_order_once():
    from interop.trainer_logprobs import LOGPROB_FORMS, logprob_order_for

    named = [logprob_order_for(form, width) for form in LOGPROB_FORMS for width in LOGPROB_BLOCK_WIDTHS]
    assert sorted(named) == sorted(o for o, (width, _) in LOGPROB_ORDERS.items() if width is not None)
    with pytest.raises(ValueError, match=r"block_size=8192 must be one of \[32768, 16384\]"):
        logprob_order_for("neg-ce", 8192)


# -- any vocabulary size: the last block completed with -inf logits ---------------------------------


@pytest.mark.parametrize("vocab,block", [(151936, 32768), (128256, 32768), (129280, 16384),
                                         (1001, 16384), (32768 + 1, 32768)])
def test_last_block_is_completed_with_neg_inf(vocab, block):
    shifted, completed = shifted_logits_and_completed(5, vocab, block, seed=vocab)
    blocks = completed.shape[1] // block
    fn = jax.jit(block_sumexp_fixed_tree, static_argnames="block_size")
    got = np.asarray(fn(shifted, block_size=block))
    assert got.shape == (5, blocks)
    # The same leaf on the explicitly completed row, and numpy's fold of XLA's exp of that row
    # (the exp values are XLA's; every add is numpy's IEEE add): one function, bit for bit.
    assert np.array_equal(bits(got), bits(fn(completed, block_size=block)))
    e = np.asarray(jax.jit(jnp.exp)(completed)).reshape(5, blocks, block)
    assert np.array_equal(bits(got), bits(numpy_halving_tree(e)))
    assert (bits(e[:, -1, vocab - (blocks - 1) * block:]) == 0).all()  # exp(-inf) is +0.0
    # The trainer's twin (the same compiled leaf through DLPack) agrees.
    torch = pytest.importorskip("torch")
    assert np.array_equal(bits(got), bits(torch_block_sumexp(torch.from_numpy(shifted),
                                                             block_size=block).numpy()))


def test_negative_control_truncated_last_block_differs():
    """The check above can fail: folding the last block's real columns in their own (shorter) tree
    instead of the completed block's tree gives other bits for some rows."""
    rng = np.random.default_rng(7)
    vocab, block = 151936, 32768
    x = (rng.standard_normal((64, vocab)) * 3).astype(np.float32)
    shifted = x - x.max(-1, keepdims=True)
    got = bits(block_sumexp_fixed_tree(jnp.asarray(shifted), block_size=block))
    e = np.asarray(jax.jit(jnp.exp)(shifted))
    truncated = numpy_halving_tree(e[:, (vocab // block) * block:])
    assert (bits(truncated) != got[:, -1]).any()


def test_odd_vocab_logprobs_are_row_invariant_and_correct(invariant_plan):
    vocab = 151936
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((16, vocab)) * 3).astype(np.float32)
    t = rng.integers(0, vocab, 16).astype(np.int32)
    t[0] = vocab - 1  # a token of the completed block
    for order in ("blockwise", "blockwise-direct-16384"):
        fn = jax.jit(lambda a, b, o=order: gather_token_logprobs(a, b, o, invariant_plan))
        assert invariance_failures(fn, (x, t), ms=(1, 3, 16)) == []
        # Error budget as for whole blocks: one rounding of x - max, the trees, a log.
        np.testing.assert_allclose(np.asarray(fn(x, t)), numpy_logprobs(x, t), rtol=1e-6, atol=1e-5)


def test_torch_log_softmax_vs_our_torch_order(logits, token_ids, invariant_plan):
    """Measured, not assumed: the count of differing bits is reported (XLA's exp is not torch's)."""
    torch = pytest.importorskip("torch")
    ours = np.asarray(gather_token_logprobs(logits, token_ids, "torch", invariant_plan))
    theirs = torch.log_softmax(torch.from_numpy(logits), -1).gather(
        -1, torch.from_numpy(token_ids.astype(np.int64))[:, None])[:, 0].numpy()
    differing = int((bits(ours) != bits(theirs)).sum())
    print(f"\ntorch.log_softmax vs jengine torch order: {differing} of {N} logprobs differ in bits, "
          f"max |diff| {np.abs(ours - theirs).max():.3g}")
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-5)


# -- top_logprobs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["torch", "blockwise", "blockwise-direct-16384"])
def test_top_logprobs_equal_gathered_values_bitwise(logits, invariant_plan, order):
    values, ids = jax.jit(lambda x: top_logprobs(x, 5, order, invariant_plan))(logits[:7])
    flat_ids = np.asarray(ids).reshape(-1)
    rows = np.repeat(logits[:7], 5, axis=0)
    gathered = gather_token_logprobs(rows, flat_ids, order, invariant_plan)
    assert np.array_equal(bits(values).reshape(-1), bits(gathered))
    assert np.array_equal(np.asarray(ids), np.argsort(-logits[:7], axis=-1, kind="stable")[:, :5])
    fn = jax.jit(lambda x: jnp.concatenate(
        [jax.lax.bitcast_convert_type(top_logprobs(x, 5, order, invariant_plan)[0], jnp.int32),
         top_logprobs(x, 5, order, invariant_plan)[1]], axis=-1))
    assert invariance_failures(fn, (logits,), ms=(1, 3, 7)) == []


def test_top_logprobs_ties_take_lowest_ids(invariant_plan):
    x = np.zeros((1, V), np.float32)
    x[0, [9000, 7, 300, 31000]] = 4.0
    _, ids = top_logprobs(jnp.asarray(x), 6, "blockwise", invariant_plan)
    assert np.asarray(ids).tolist() == [[7, 300, 9000, 31000, 0, 1]]


# -- canonical argmax --------------------------------------------------------------------------------


def test_argmax_exact_ties_signed_zeros_and_nan():
    x = np.full((5, V), -1.0, np.float32)
    x[0, [4000, 17, 30000]] = 2.5               # exact tie -> 17
    x[1, 3], x[1, 2] = 0.0, -0.0                # signed zeros are one key -> 2
    x[1, :2] = -3.0
    x[2, [100, 50]] = np.nan                    # NaN policy: first NaN
    x[3] = -np.inf                              # all -inf -> 0
    x[4, V - 1] = 1.0
    got = np.asarray(canonical_argmax(jnp.asarray(x))).tolist()
    assert got == [17, 2, 50, 0, V - 1]
    # Negative control: lax.top_k orders +0.0 above -0.0, so it is not canonical on row 1.
    assert int(jax.lax.top_k(jnp.asarray(x[1:2]), 1)[1][0, 0]) == 3


def test_argmax_row_invariant_and_matches_numpy(logits):
    tied = logits.copy()
    tied[::3, 1234] = tied[::3, 99] = tied[::3].max(-1) + 1  # exact ties in a third of the rows
    fn = jax.jit(canonical_argmax)
    assert invariance_failures(fn, (tied,)) == []
    assert np.array_equal(np.asarray(fn(tied)), np.argmax(tied, axis=-1))


# -- Gumbel-max sampler --------------------------------------------------------------------------------

_gumbel = jax.jit(gumbel_sample, static_argnames=("use_top_k", "use_top_p"))


def test_gumbel_row_invariant_over_cobatch_and_offset(logits, sampling_rows):
    assert invariance_failures(_gumbel, (logits, *sampling_rows)) == []


def test_gumbel_control_keyed_by_row_is_caught(logits, sampling_rows):
    def keyed_by_row(x, t, k, p, mp, seed, pos):
        return gumbel_sample(x, t, k, p, mp, seed, jnp.arange(x.shape[0], dtype=jnp.int32))
    assert invariance_failures(jax.jit(keyed_by_row), (logits, *sampling_rows), ms=(2, 4))


def test_gumbel_fast_paths_are_bit_identical(logits, sampling_rows):
    t, k, p, mp, seed, pos = sampling_rows
    off = (t, np.full(N, -1, np.int32), np.ones(N, np.float32), mp, seed, pos)
    full = _gumbel(logits, *off, use_top_k=True, use_top_p=True)
    assert np.array_equal(full, _gumbel(logits, *off, use_top_k=False, use_top_p=False))
    greedy = (np.zeros(N, np.float32),) + sampling_rows[1:]
    assert np.array_equal(_gumbel(logits, *greedy), canonical_argmax(jnp.asarray(logits)))


def test_seeds_and_positions_change_the_draw():
    flat = np.zeros((16, V), np.float32)  # uniform over 32768 tokens
    ones, none = np.ones(16, np.float32), np.full(16, -1, np.int32)
    args = (ones, none, ones, np.zeros(16, np.float32))
    by_seed = np.asarray(_gumbel(flat, *args, np.arange(16, dtype=np.uint32), np.zeros(16, np.int32)))
    by_pos = np.asarray(_gumbel(flat, *args, np.zeros(16, np.uint32), np.arange(16, dtype=np.int32)))
    assert len(set(by_seed.tolist())) >= 14 and len(set(by_pos.tolist())) >= 14
    again = np.asarray(_gumbel(flat, *args, np.arange(16, dtype=np.uint32), np.zeros(16, np.int32)))
    assert np.array_equal(by_seed, again)


def _draws(probs, n, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    x = np.tile(np.log(np.asarray(probs, np.float32)), (n, 1))
    full = lambda v, d: np.full(n, v, d)
    out = _gumbel(x, full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
                  full(min_p, np.float32), np.arange(n, dtype=np.uint32), full(3, np.int32))
    return np.bincount(np.asarray(out), minlength=len(probs)) / n


def test_gumbel_distribution_temperature_and_filters():
    probs = np.array([0.5, 0.25, 0.15, 0.1])
    n = 4000  # standard error of a frequency <= 0.008; tolerance 0.03 is ~4 sigma
    np.testing.assert_allclose(_draws(probs, n), probs, atol=0.03)
    sharp = probs**2 / (probs**2).sum()  # T = 0.5
    np.testing.assert_allclose(_draws(probs, n, temperature=0.5), sharp, atol=0.03)
    for kwargs, kept in [({"top_k": 2}, [0, 1]), ({"top_p": 0.6}, [0, 1]), ({"top_p": 0.4}, [0]),
                         ({"top_p": 0.8}, [0, 1, 2]), ({"min_p": 0.4}, [0, 1]),
                         ({"min_p": 0.25, "top_k": 3}, [0, 1, 2])]:
        ref = np.zeros(4)
        ref[kept] = probs[kept] / probs[kept].sum()
        np.testing.assert_allclose(_draws(probs, n, **kwargs), ref, atol=0.03, err_msg=str(kwargs))


# -- the Sampler -----------------------------------------------------------------------------------------


def stand_in(order="blockwise", features=frozenset({"batch_invariant"})):
    """The sampler's part of a launch plan, made directly (jengine.launch.SamplerOptions)."""
    return SamplerOptions(logprob_order=order, hardware="cpu", required_features=frozenset(features))


def rows_of(sampling_rows, idx):
    t, k, p, mp, seed, pos = (a[idx] for a in sampling_rows)
    return SamplingRows(temperature=t, top_k=k, top_p=p, min_p=mp, seed=seed, position=pos)


def test_sampler_padding_never_changes_a_row(logits, token_ids, sampling_rows):
    sampler = Sampler(stand_in(), V)
    assert sampler.describe()["block_sumexp"] == "fixed_tree"
    assert [row_bucket(s) for s in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64]
    x = jnp.asarray(logits[:5])
    lp = sampler.token_logprobs(x, token_ids[:5])
    alone = np.concatenate([sampler.token_logprobs(x[i:i + 1], token_ids[i:i + 1]) for i in range(5)])
    assert lp.dtype == np.float32 and np.array_equal(bits(lp), bits(alone))
    toks = sampler.sample(x, rows_of(sampling_rows, slice(0, 5)))
    alone = [int(sampler.sample(x[i:i + 1], rows_of(sampling_rows, slice(i, i + 1)))[0]) for i in range(5)]
    assert toks.dtype == np.int32 and toks.tolist() == alone
    values, ids = sampler.top_logprobs(x, 3)
    assert values.shape == (5, 3) and ids.dtype == np.int32
    assert np.array_equal(bits(values[:, 0]), bits(sampler.token_logprobs(x, ids[:, 0])))
    # On the device: 5 rows pad to 8 (padding zeroed); 8 rows fill their bucket (nothing to zero)
    for s in (5, 8):
        on_device = np.asarray(sampler.sample_on_device(jnp.asarray(logits[:s]),
                                                        rows_of(sampling_rows, slice(0, s))))
        host = sampler.sample(jnp.asarray(logits[:s]), rows_of(sampling_rows, slice(0, s)))
        assert on_device.dtype == np.int32 and on_device.shape == (row_bucket(s),)
        assert on_device[:s].tolist() == host.tolist() and not on_device[s:].any()


def test_sampler_auto_plans_native_and_refuses_bad_input(logits):
    auto = Sampler(stand_in("torch", frozenset()), V)
    assert auto.describe()["block_sumexp"] == "xla_native"
    ids = np.arange(4, dtype=np.int32)
    np.testing.assert_allclose(auto.token_logprobs(jnp.asarray(logits[:4]), ids),
                               numpy_logprobs(logits[:4], ids), rtol=1e-6, atol=1e-5)
    assert Sampler(stand_in("blockwise"), 1000).block_width == 32768  # one completed block
    with pytest.raises(ValueError, match="megatron"):
        Sampler(stand_in("megatron"), V)
    sampler = Sampler(stand_in(), V)
    with pytest.raises(ValueError, match=r"token_ids\[1\]=32768"):
        sampler.token_logprobs(jnp.asarray(logits[:2]), np.array([0, V]))
    with pytest.raises(ValueError, match="vocab_size=32768"):
        sampler.token_logprobs(jnp.zeros((2, 100)), np.array([0, 1]))
    assert sampler.sample(jnp.zeros((0, V)), rows_of([np.zeros(0)] * 6, slice(None))).shape == (0,)


def test_sampler_plans_from_a_real_launch_plan():
    from jengine.config import LaunchConfig
    from jengine.launch import plan_launch
    from jengine.numerics import resolve_launch
    from jengine.profiles import override_profile
    from tests.test_engine_scheduler import fake_model_config

    def options(numerics):
        with override_profile("FakeForCausalLM", numerics_envelopes={numerics}):
            return plan_launch(resolve_launch(LaunchConfig(numerics=numerics)),
                               fake_model_config(64)).sampler

    bitwise = Sampler(options("rl-bitwise"), V).describe()
    auto = Sampler(options("auto"), V).describe()
    assert (bitwise["block_sumexp"], auto["block_sumexp"]) == ("fixed_tree", "xla_native")
    assert bitwise["logprob_order"] == "blockwise"  # rl-bitwise folds torch to blockwise
