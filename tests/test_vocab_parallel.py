"""The vocab-parallel head (sharding/vocab_parallel.py): at 1, 2, 4 and 8 shards its argmax,
token logprobs and top-k alternatives are the unsharded Sampler functions' ids and float bits.
tests/vocab_parallel_probe.py measures on 8 fake CPU devices in a subprocess (see
tests/fake_devices.py); the claims are asserted here. The block-layout refusals and the key's order
need no devices and run in this process."""

import jax.numpy as jnp
import numpy as np
import pytest

from sharding.vocab_parallel import check_block_aligned, orderable_key
from tests.fake_devices import run_probe

SHARDS = ("1", "2", "4", "8")
ORDERS = ("blockwise", "blockwise-direct-16384")


@pytest.fixture(scope="module")
def probe():
    return run_probe("vocab_parallel_probe.py")


def test_the_adversarial_rows_are_what_they_claim(probe):
    """The unsharded canonical argmax on each named row: lowest index among ties (here on ranks 1
    and 2, none on rank 0), -0.0 equal to +0.0, the max in the last partial block."""
    k = probe["kernel"]
    assert k["devices"] == 8
    assert k["reference_argmax"] == {"tie_across_ranks": 16390, "tie_late": 16400,
                                     "neg_zero_first": 10, "pos_zero_first": 10,
                                     "all_neg_inf_but_last": 32890, "max_in_last_block": 32851}
    assert k["nan_reference_argmax"] == [20000, 32890]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shards", SHARDS)
def test_vocab_parallel_matches_unsharded_bitwise(probe, order, shards):
    """Ids exact, logprob float bits equal (argmax, last-column and random targets), top-6 values
    and ids equal; NaN rows pick the lowest NaN index; junk past the vocabulary is ignored."""
    run = probe["kernel"]["orders"][order][shards]
    assert run["argmax_ids_differing"] == 0
    assert run["nan_argmax"] == probe["kernel"]["nan_reference_argmax"]
    assert run["logprob_bits_differing"] == {"argmax": 0, "last_column": 0, "random": 0}
    assert run["top_value_bits_differing"] == 0
    assert run["top_ids_differing"] == 0
    if shards != "1":  # the vocabulary (32891) is padded to whole blocks on every rank
        assert run["columns_per_rank"] * int(shards) > 32891


def test_a_key_without_canonical_zeros_picks_another_id(probe):
    """Negative control: packing the raw float bits (+0.0 above -0.0) picks the later +0.0 on the
    row whose -0.0 comes first, at every shard count; the canonical key does not."""
    for shards in SHARDS[1:]:
        assert probe["kernel"]["orders"]["blockwise"][shards]["naive_argmax_rows_differing"] == [
            "neg_zero_first"]


def test_folding_the_blocks_right_to_left_changes_bits(probe):
    """Negative control: the same three 16384-wide block partials folded right to left give other
    bits on some row, so the vocabulary-order fold is what the equality above rests on."""
    assert probe["kernel"]["orders"]["blockwise-direct-16384"][
        "right_to_left_fold_bits_differing"] > 0


def test_runner_head_matches_the_sampler_on_gathered_logits(probe):
    """ModelRunner.score_rows on the tiny model at TP2 (rl-bitwise, blockwise-16384): greedy ids,
    target logprob bits and top-3 alternatives equal the Sampler's on logits_at; so do the greedy
    step's own-target logprobs. With 32768-wide blocks (one block over two ranks) the runner says
    it cannot, and the engine's step gathers the logits instead."""
    run = probe["runner"]
    assert run["rows"] > 0 and run["scores_without_gather"] is True
    for field in ("greedy_ids_differing", "logprob_bits_differing", "top_ids_differing",
                  "top_logprob_bits_differing", "greedy_target_ids_differing",
                  "greedy_target_logprob_bits_differing"):
        assert run[field] == 0, field
    assert run["blockwise_scores_without_gather"] is False


@pytest.mark.parametrize("order, vocab, v_local, world, message", [
    ("blockwise", 65536, 32768, 2, None),
    ("blockwise-16384", 40000, 16384, 4, None),  # rank 3 holds padding only
    ("blockwise", 40000, 65536, 2, None),  # only rank 0 holds real columns
    ("torch", 1000, 1000, 1, None),
    ("blockwise", 40000, 20000, 2, r"rank 1 starts at column 20000 \(V_local=20000, "
                                   r"vocab_size=40000, 2 ranks\).*32768-wide block"),
    ("torch", 2000, 1000, 2, r"'torch' sums the whole row in one tree"),
    ("nope", 2000, 1000, 2, r"--logprob-order='nope' is not one of"),
])
def test_block_layout_is_checked(order, vocab, v_local, world, message):
    if message is None:
        assert check_block_aligned(order, vocab, v_local, world) in (vocab, 16384, 32768)
    else:
        with pytest.raises(ValueError, match=message):
            check_block_aligned(order, vocab, v_local, world)


def test_orderable_key_orders_like_the_floats():
    """Strictly increasing keys along increasing floats, one key for both zeros, NaN on top.
    Smallest normals, not subnormals: XLA's CPU flushes those to zero (keyed as zero, as
    canonical_argmax's == sees them)."""
    values = np.array([-np.inf, -3e38, -1.0, -1.2e-38, 0.0, 1.2e-38, 1.0, 3e38, np.inf],
                      np.float32)
    keys = np.asarray(orderable_key(jnp.asarray(values)))
    assert np.all(np.diff(keys.astype(np.int64)) > 0)
    special = np.asarray(orderable_key(jnp.asarray(np.array([-0.0, 0.0, np.nan, -np.nan],
                                                            np.float32))))
    assert special[0] == special[1] == keys[4]
    assert special[2] == special[3] > keys[-1]
