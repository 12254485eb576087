"""The vocab-parallel head on 1, 2, 4 and 8 fake CPU devices against the unsharded Sampler
functions, measured and printed as one JSON object (run by tests/test_vocab_parallel.py; XLA reads
the fake device count once per process). Every entry is a count of differing float bits or ids;
the assertions live in the test.

The rows are adversarial: exact ties at the max across ranks, -0.0 beside +0.0 as the max, all -inf
but one column, the max in the last (partial) block, NaN; the vocabulary (8 * 4096 + 123) is not a
whole number of blocks, and every rank's columns past it hold junk (NaN, 1e30) that must read as -inf.
"""

import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from pallas_kernels.logprobs import (canonical_row_max, finish_logprob,  # noqa: E402
                                     fold_block_partials, gather_token_logprobs,
                                     logprob_block_width, num_blocks, top_logprobs)
from pallas_kernels.registry import plan  # noqa: E402
from pallas_kernels.sampling import canonical_argmax  # noqa: E402
from sharding.mesh import TENSOR_AXIS, make_mesh  # noqa: E402
from sharding.vocab_parallel import (vocab_parallel_argmax,  # noqa: E402
                                     vocab_parallel_token_logprobs, vocab_parallel_top_logprobs)
from tests.bits import count_bit_differences  # noqa: E402

VOCAB = 8 * 4096 + 123
ORDERS = ("blockwise", "blockwise-direct-16384")  # both forms, both widths
SHARDS = (1, 2, 4, 8)
TOP_K = 6
ROWS = 16


def adversarial_rows() -> tuple[np.ndarray, dict[str, int]]:
    """[ROWS, VOCAB] f32 and the row number of each named case (the rest are random rows)."""
    rng = np.random.default_rng(17)
    x = (rng.standard_normal((ROWS, VOCAB)) * 4).astype(np.float32)
    x[8:] = np.round(x[8:])  # coarse values: many exact ties everywhere, top-k included
    case = {}

    def row(name, values):
        case[name] = len(case)
        x[case[name]] = values

    neg = -np.abs(x[0]) - 1  # every value below zero
    tie = x[1].copy()
    tie[[32800, 16390, 16391]] = 50.0  # equal maxima on ranks 1 and 2 (16384 wide), none on 0
    row("tie_across_ranks", tie)
    tie_high = x[2].copy()
    tie_high[[32890, 16400]] = 50.0  # tied in the middle and in the last partial block
    row("tie_late", tie_high)
    zeros = neg.copy()
    zeros[10], zeros[20000] = -0.0, 0.0  # -0.0 first: a naive key would prefer the later +0.0
    row("neg_zero_first", zeros)
    zeros = neg.copy()
    zeros[10], zeros[20000] = 0.0, -0.0
    row("pos_zero_first", zeros)
    lone = np.full(VOCAB, -np.inf, np.float32)
    lone[VOCAB - 1] = 1.5
    row("all_neg_inf_but_last", lone)
    last = x[5].copy()
    last[VOCAB - 40] = 30.0
    row("max_in_last_block", last)
    return x, case


NAN_ROWS = np.full((2, VOCAB), 1.0, np.float32)
NAN_ROWS[0, [20000, 30000]] = np.nan  # argmax: the lowest NaN index, whatever the values
NAN_ROWS[1, [3, 32890]] = [np.inf, np.nan]


def local_width(shards: int, width: int) -> int:
    """Columns per rank: the whole vocabulary on one rank, else whole blocks covering it."""
    if shards == 1:
        return VOCAB
    return -(-VOCAB // (shards * width)) * width


def padded(x: np.ndarray, columns: int) -> np.ndarray:
    """x widened to `columns` with junk past the vocabulary (read as -inf by the head)."""
    out = np.full((x.shape[0], columns), np.nan, np.float32)
    out[:, 1::2] = 1e30
    out[:, : x.shape[1]] = x
    return out


def naive_argmax(local, axis):
    """The control: the packed key from the raw float bits (no canonical zero)."""
    v_local = local.shape[1]
    column = lax.axis_index(axis) * v_local + lax.broadcasted_iota(jnp.int32, local.shape, 1)
    bits = lax.bitcast_convert_type(jnp.where(column < VOCAB, local, -jnp.inf), jnp.int32)
    raw = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    best = jnp.max(raw, axis=-1, keepdims=True)
    idx = jnp.argmax(raw == best, axis=-1).astype(jnp.int32)  # lowest local index of the raw max
    key = jnp.take_along_axis(raw, idx[:, None], axis=-1)[:, 0]
    gidx = idx + lax.axis_index(axis) * v_local
    with jax.enable_x64(True):
        packed = (key.astype(jnp.int64) << 32) | (jnp.int64(0xFFFFFFFF) - gidx.astype(jnp.int64))
        best = lax.pmax(packed, axis)
        return (jnp.int64(0xFFFFFFFF) - (best & jnp.int64(0xFFFFFFFF))).astype(jnp.int32)


def sharded(fn, mesh, logits, *extra):
    """fn(local logits, *extra) under shard_map, logits split on vocab, everything else whole."""
    rep = PartitionSpec()
    spec = PartitionSpec(None, TENSOR_AXIS)
    body = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) + (rep,) * len(extra), out_specs=rep,
                         check_vma=False)
    placed = jax.device_put(logits, NamedSharding(mesh, spec))
    return jax.tree.map(np.asarray, jax.jit(body)(placed, *extra))


def right_to_left_control(x, order, block_plan) -> int:
    """Rows whose argmax logprob changes bits when the block partials are folded right to left
    (the wrong order a reduction over ranks could take) instead of in vocabulary order."""
    width = logprob_block_width(order, VOCAB)
    xs = jnp.asarray(x)
    shifted = xs - canonical_row_max(xs)
    partials = block_plan(shifted, block_size=width)
    target = jnp.take_along_axis(shifted, canonical_argmax(xs)[:, None], -1)[:, 0]
    forward, backward = (finish_logprob(target, jnp.log(fold_block_partials(p)), True)
                         for p in (partials, partials[:, ::-1]))
    return count_bit_differences(np.asarray(forward), np.asarray(backward))


def kernel_probe() -> dict:
    x, case = adversarial_rows()
    common = dict(formats={"f32"}, hardware="cpu", features={"batch_invariant"})
    rng = np.random.default_rng(3)
    ids = {"argmax": np.asarray(canonical_argmax(jnp.asarray(x))),
           "last_column": np.full(ROWS, VOCAB - 1, np.int32),
           "random": rng.integers(0, VOCAB, ROWS).astype(np.int32)}
    out = {"cases": case, "devices": len(jax.devices()), "orders": {}}
    reference_ids = np.asarray(canonical_argmax(jnp.asarray(x)))
    nan_reference = np.asarray(canonical_argmax(jnp.asarray(NAN_ROWS))).tolist()
    out["reference_argmax"] = {name: int(reference_ids[r]) for name, r in case.items()}
    out["nan_reference_argmax"] = nan_reference
    for order in ORDERS:
        width = logprob_block_width(order, VOCAB)
        block_plan = plan("sampling", "block_sumexp",
                          geometry={"vocab_size": VOCAB, "block_size": width}, **common)
        ref_lp = {name: np.asarray(gather_token_logprobs(x, t, order, block_plan))
                  for name, t in ids.items()}
        ref_top = [np.asarray(a) for a in top_logprobs(x, TOP_K, order, block_plan)]
        per_order = {}
        for shards in SHARDS:
            mesh = make_mesh(tp=shards)
            columns = shards * local_width(shards, width)
            wide = padded(np.concatenate([x, NAN_ROWS]), columns)  # NaN rows: argmax only

            def head(local, *targets):
                kw = dict(vocab_size=VOCAB)
                rows = local[:ROWS]
                return (vocab_parallel_argmax(local, TENSOR_AXIS, **kw),
                        [vocab_parallel_token_logprobs(rows, t, order, block_plan, **kw)
                         for t in targets],
                        vocab_parallel_top_logprobs(rows, TOP_K, order, block_plan, **kw))

            all_ids, got_lp, (top_v, top_i) = sharded(head, mesh, wide, *ids.values())
            got_ids, nan_ids = all_ids[:ROWS], all_ids[ROWS:]
            entry = {
                "columns_per_rank": columns // shards,
                "argmax_ids_differing": int(np.count_nonzero(got_ids != reference_ids)),
                "nan_argmax": nan_ids.tolist(),
                "logprob_bits_differing": {name: count_bit_differences(ref_lp[name], got)
                                           for name, got in zip(ids, got_lp)},
                "top_value_bits_differing": count_bit_differences(ref_top[0], top_v),
                "top_ids_differing": int(np.count_nonzero(ref_top[1] != top_i)),
            }
            if shards > 1 and order == ORDERS[0]:  # the argmax does not depend on the order
                naive = sharded(lambda local: naive_argmax(local, TENSOR_AXIS), mesh, wide)
                entry["naive_argmax_rows_differing"] = sorted(
                    name for name, r in case.items() if naive[r] != reference_ids[r])
            per_order[str(shards)] = entry
        if num_blocks(VOCAB, width) > 2:  # two partials add the same either way round
            per_order["right_to_left_fold_bits_differing"] = right_to_left_control(x, order,
                                                                                  block_plan)
        out["orders"][order] = per_order
    return out


def runner_probe() -> dict:
    """The tiny model at TP2 (vocab 32768: 16384 columns per rank): ModelRunner.score_rows against
    the Sampler on the gathered logits (logits_at)."""
    from jengine.config import LaunchConfig
    from jengine.engine.batch import SamplingRows, StepBatch
    from jengine.engine.model_runner import ModelRunner
    from jengine.engine.sampler import Sampler
    from jengine.launch import plan_launch
    from jengine.models import load_model
    from jengine.numerics import resolve_launch

    tiny = load_model("tiny", progress=False)
    launch = LaunchConfig(numerics="rl-bitwise", logprob_order="blockwise-16384",
                          max_total_tokens=512, chunked_prefill_size=32, max_prefill_tokens=64,
                          max_running_requests=4, skip_warmup=True)
    launch_plan = plan_launch(resolve_launch(launch, hardware="cpu", probe_xla_flags=False),
                              tiny.config)
    runner = ModelRunner(tiny.config, tiny.checkpoint,
                         dataclasses.replace(launch_plan.runner, tp_size=2))
    sampler = Sampler(launch_plan.sampler, tiny.config.vocab_size)
    prompt = np.random.default_rng(0).integers(1, tiny.config.vocab_size, 13).tolist()
    pages = -(-len(prompt) // runner.page_size)
    batch = StepBatch(input_ids=prompt, positions=list(range(len(prompt))),
                      token_req=[0] * len(prompt), block_tables=[list(range(1, 1 + pages))],
                      hidden_rows=list(range(len(prompt))))
    hidden = runner.forward_padded(batch)
    rows = np.arange(len(prompt) - 1)
    targets = np.asarray(prompt[1:], np.int32)
    logits = runner.logits_at(hidden, rows)
    n = len(rows)
    greedy = SamplingRows(temperature=np.zeros(n, np.float32), top_k=np.full(n, -1, np.int32),
                          top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32),
                          seed=np.zeros(n, np.uint32), position=np.zeros(n, np.int32))
    want_ids = sampler.sample(logits, greedy)
    want_lp = sampler.token_logprobs(logits, targets)
    got_ids, got_lp, (top_values, top_ids) = runner.score_rows(hidden, rows, sampler,
                                                                target_ids=targets, k=3)
    want_values, want_top_ids = sampler.top_logprobs(logits, 3, n)
    own_ids, own_lp, _ = runner.score_rows(hidden, rows, sampler)  # greedy targets, one program
    out = {"rows": len(rows), "greedy_ids_differing": int(np.count_nonzero(got_ids != want_ids)),
           "logprob_bits_differing": count_bit_differences(want_lp, got_lp),
           "top_ids_differing": int(np.count_nonzero(top_ids != want_top_ids)),
           "top_logprob_bits_differing": count_bit_differences(want_values, top_values),
           "greedy_target_ids_differing": int(np.count_nonzero(own_ids != want_ids)),
           "greedy_target_logprob_bits_differing": count_bit_differences(
               sampler.token_logprobs(logits, want_ids), own_lp),
           "scores_without_gather": runner.scores_without_gather(sampler)}
    wide_order = dataclasses.replace(launch_plan.sampler, logprob_order="blockwise")
    # 32768-wide blocks do not fit 16384 columns per rank: that launch gathers the logits
    out["blockwise_scores_without_gather"] = runner.scores_without_gather(
        Sampler(wide_order, tiny.config.vocab_size))
    return out


if __name__ == "__main__":
    print(json.dumps({"kernel": kernel_probe(), "runner": runner_probe()}))
