"""The vocab-parallel LM head's greedy token and logprobs, with no rank holding a whole logits row.

Inside `jax.shard_map` over the "tensor" axis, rank r holds the logits columns
[r * V_local, (r + 1) * V_local) of every row (the LM head's weight is split on "vocab",
sharding/rules.py). Gathering the rows ([rows, V] f32 per step) and running the Sampler on them is
what TensorParallel.gather_vocab does today; these functions return the same bits while moving only
[rows] keys, [rows, blocks] partials and [rows, k] candidates:

  argmax      each rank packs its canonical argmax into an int64 key (value, then lowest global
              index), one MAX all-reduce picks the row's winner (spec: "Vocabulary-parallel argmax").
  logprobs    the row max is a MAX all-reduce (exact); each rank sums exp over its WHOLE blocks with
              the sampler's block_sumexp leaf, the [rows, blocks] partials are all-gathered and
              folded left to right in vocabulary order by the unsharded fold
              (pallas_kernels.logprobs.fold_block_partials); the target's shifted logit is moved
              from its owning rank by a gather (bytes, no arithmetic: a sum could turn -0.0 into +0.0).
  top-k       each rank's top k (same key: zeros as one, lowest id first) is all-gathered and merged
              by the same lax.top_k, whose equal keys keep the lower position (= lower global id).

Every value is therefore a function of the row alone, whatever the shard count: the unsharded
Sampler's bits (tests/test_vocab_parallel.py compares float bits at 1, 2, 4 and 8 shards).

Padded vocabularies: `vocab_size` (default: all W * V_local columns) is the real output vocabulary;
columns at or past it are padding, read as -inf whatever they hold, so a head padded to whole blocks
per rank scores exactly like the unpadded one.

Blocks: the blockwise orders need every rank that holds real columns to start at a block boundary
(V_local a multiple of the order's width, unless only rank 0 holds real columns), so no block straddles
two ranks; the last real block is completed with -inf as in the unsharded leaves. Anything else is
refused, naming the sizes. The "torch" order sums the whole row in one tree that no split of the row
reproduces, so it is refused for vocab-parallel use; a launch that wants it must gather the row.

Signed zeros and NaN follow the unsharded leaves: -0.0 and +0.0 are one key (the lowest index wins
their tie); a row holding a NaN selects its lowest NaN index (canonical_argmax's policy) and gets NaN
logprobs (the NaN's payload is not promised).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jengine.logprob_orders import LOGPROB_ORDERS
from pallas_kernels.logprobs import finish_logprob, fold_block_partials, logprob_block_width, num_blocks
from pallas_kernels.registry import KernelPlan
from pallas_kernels.sampling import canonical_argmax
from sharding.mesh import TENSOR_AXIS

_NAN_KEY = 0x7FFFFFFF  # above +inf's key (0x7F800000): a NaN beats every number, as in canonical_argmax
_LOW_MASK = 0xFFFFFFFF


# -- where this rank's columns sit -------------------------------------------------------------------


def _shard_columns(local_logits, axis: str, vocab_size: int | None):
    """(f32 local logits with padding columns at -inf, global column index [1, V_local], vocab)."""
    if local_logits.ndim != 2:
        raise ValueError(f"vocab-parallel head: local_logits must be [rows, V_local], got shape "
                         f"{local_logits.shape}")
    world, v_local = lax.axis_size(axis), local_logits.shape[1]
    full = world * v_local
    vocab = full if vocab_size is None else vocab_size
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= full:
        raise ValueError(f"vocab-parallel head: vocab_size={vocab_size!r} must be an int in "
                         f"[1, {full}] ({world} ranks x V_local={v_local} columns)")
    rank = lax.axis_index(axis)
    column = rank * v_local + lax.broadcasted_iota(jnp.int32, (1, v_local), 1)
    x = local_logits.astype(jnp.float32)  # bf16 -> f32 is exact
    if vocab < full:
        x = jnp.where(column < vocab, x, -jnp.inf)
    return x, column, vocab


def check_block_aligned(order: str, vocab_size: int, v_local: int, world: int) -> int:
    """The order's block width, after checking that no block straddles two ranks (see module doc)."""
    if order not in LOGPROB_ORDERS:
        raise ValueError(f"--logprob-order={order!r} is not one of {list(LOGPROB_ORDERS)}")
    if LOGPROB_ORDERS[order][0] is None and world > 1:
        raise ValueError(f"--logprob-order={order!r} sums the whole row in one tree, which a "
                         f"vocab-parallel head split {world} ways cannot reproduce; use a blockwise "
                         "order or gather the row (TensorParallel.gather_vocab)")
    width = logprob_block_width(order, vocab_size)
    for rank in range(1, world):
        start = rank * v_local
        if start < vocab_size and start % width:
            raise ValueError(
                f"vocab-parallel logprobs ({order}): rank {rank} starts at column {start} "
                f"(V_local={v_local}, vocab_size={vocab_size}, {world} ranks), not a multiple of "
                f"the {width}-wide block, so a block would straddle two ranks; pad V_local to a "
                f"multiple of {width}")
    return width


# -- argmax -------------------------------------------------------------------------------------------


def orderable_key(x: jax.Array) -> jax.Array:
    """int32 keys ordered as the f32 values: -0.0 takes +0.0's key, every NaN one key above +inf.

    A non-negative float's bits already order as an int32; a negative one's order is reversed, so
    its 31 low bits are flipped (it stays negative, below every non-negative key). Zero is tested
    with the platform's ==, as canonical_argmax tests ties, so a subnormal keys as zero where the
    platform flushes subnormals (XLA's CPU) and as itself where it does not: the same ties either way.
    """
    x = jnp.where(x == 0, jnp.zeros_like(x), x)  # -0.0 -> +0.0: one key for both zeros
    bits = lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jnp.where(jnp.isnan(x), jnp.int32(_NAN_KEY), key)


def vocab_parallel_argmax(local_logits: jax.Array, axis: str = TENSOR_AXIS, *,
                          vocab_size: int | None = None,
                          local_argmax: KernelPlan | None = None) -> jax.Array:
    """int32[R]: the canonical argmax of the whole row (pallas_kernels.sampling.canonical_argmax's
    bits), from this rank's columns. `local_argmax` is the Sampler's argmax plan (default: the
    canonical leaf itself).

    The spec's packed int64 key: (orderable value key << 32) | (2**32 - 1 - global index), so one
    MAX all-reduce picks the largest value and, among equal ones, the lowest global index. JAX runs
    with x64 off, so the key is built inside `jax.enable_x64(True)`: on jax 0.10.2 that scope works
    inside a jitted shard_map body (measured: an s64 all_reduce max in the lowered program, the
    exact result) and the result leaves it as int32.
    """
    x, column, _ = _shard_columns(local_logits, axis, vocab_size)
    pick = canonical_argmax if local_argmax is None else local_argmax
    local = pick(x).astype(jnp.int32)[:, None]  # lowest index of the shard's canonical max
    value = jnp.take_along_axis(x, local, axis=-1)[:, 0]
    index = column[0, 0] + local[:, 0]  # column[0, 0] = rank * V_local
    with jax.enable_x64(True):
        low = jnp.int64(_LOW_MASK) - index.astype(jnp.int64)  # lower index -> larger key
        key = (orderable_key(value).astype(jnp.int64) << 32) | low
        best = lax.pmax(key, axis)  # MAX is exact in any order (sharding.collectives.route)
        winner = (jnp.int64(_LOW_MASK) - (best & jnp.int64(_LOW_MASK))).astype(jnp.int32)
    return winner


# -- logprobs ----------------------------------------------------------------------------------------


def _row_max(x: jax.Array, axis: str) -> jax.Array:
    """[R, 1] canonical_row_max of the whole row. NaN is made explicit rather than trusted to the
    collective's max (NCCL does not promise to propagate it)."""
    has_nan = jnp.any(jnp.isnan(x), axis=-1, keepdims=True)
    m = lax.pmax(jnp.max(jnp.where(jnp.isnan(x), -jnp.inf, x), axis=-1, keepdims=True), axis)
    m = jnp.where(lax.pmax(has_nan.astype(jnp.int32), axis) > 0, jnp.nan, m)
    return jnp.where(m == 0, jnp.zeros_like(m), m)  # pmax may pick either zero: +0.0, as unsharded


def _shifted_and_log_s(local_logits, order: str, block_sumexp_plan: KernelPlan, axis: str,
                       vocab_size: int | None):
    """(local shifted logits [R, V_local], global column [1, V_local], log(S) [R, 1], negated?)."""
    x, column, vocab = _shard_columns(local_logits, axis, vocab_size)
    world, v_local = lax.axis_size(axis), x.shape[1]
    width = check_block_aligned(order, vocab, v_local, world)
    shifted = x - _row_max(x, axis)
    partials = block_sumexp_plan(shifted, block_size=width)  # [R, blocks of this rank]
    gathered = lax.all_gather(partials, axis, axis=1, tiled=True, to="invarying")  # rank-major
    log_s = jnp.log(fold_block_partials(gathered[:, : num_blocks(vocab, width)]))[:, None]
    return shifted, column, log_s, LOGPROB_ORDERS[order][1]


def _from_owner(local_values: jax.Array, ids: jax.Array, axis: str) -> jax.Array:
    """values[r, ids[r]] of the whole row, moved from the rank holding column ids[r] [R]."""
    v_local = local_values.shape[1]
    rank = lax.axis_index(axis)
    local = jnp.take_along_axis(local_values, jnp.clip(ids - rank * v_local, 0, v_local - 1)[:, None],
                                axis=-1)[:, 0]
    parts = lax.all_gather(local, axis, axis=0, tiled=False, to="invarying")  # [W, R]
    return parts[ids // v_local, jnp.arange(ids.shape[0])]


def vocab_parallel_token_logprobs(local_logits: jax.Array, token_ids: jax.Array, order: str,
                                  block_sumexp_plan: KernelPlan, *, axis: str = TENSOR_AXIS,
                                  vocab_size: int | None = None) -> jax.Array:
    """f32[R]: gather_token_logprobs(whole rows, token_ids, order) bit for bit. token_ids [R] are
    global ids in [0, vocab_size) (the Sampler checks them on the host; not re-checked here)."""
    shifted, _, log_s, negated = _shifted_and_log_s(local_logits, order, block_sumexp_plan, axis,
                                                    vocab_size)
    target = _from_owner(shifted, jnp.asarray(token_ids, jnp.int32), axis)
    return finish_logprob(target[:, None], log_s, negated)[:, 0]


def vocab_parallel_top_logprobs(local_logits: jax.Array, k: int, order: str,
                                block_sumexp_plan: KernelPlan, *, axis: str = TENSOR_AXIS,
                                vocab_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(f32[R, k], int32[R, k]): top_logprobs(whole rows, k, order) bit for bit: the k largest
    logprobs, -0.0 and +0.0 one key, lowest global id first on ties.

    The row's top k under (key descending, id ascending) lies in the union of the ranks' own top
    k under the same order; gathered rank-major, equal keys sit in ascending global id, which the
    merging lax.top_k keeps (its documented tie rule)."""
    shifted, column, log_s, negated = _shifted_and_log_s(local_logits, order, block_sumexp_plan,
                                                         axis, vocab_size)
    vocab = lax.axis_size(axis) * shifted.shape[1] if vocab_size is None else vocab_size
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= vocab:
        raise ValueError(f"vocab_parallel_top_logprobs: k={k!r} must be an int in "
                         f"[0, vocab_size={vocab}]")
    values = finish_logprob(shifted, log_s, negated)  # padding columns: -inf, never above a real one
    key = jnp.where(values == 0, jnp.zeros_like(values), values)
    local_key, local_pos = lax.top_k(key, min(k, shifted.shape[1]))

    def gather(a):  # [R, k_local] per rank -> [R, W * k_local], rank-major
        return lax.all_gather(a, axis, axis=1, tiled=True, to="invarying")

    candidates = (gather(local_key),
                  gather(jnp.take_along_axis(values, local_pos, axis=-1)),
                  gather(jnp.take_along_axis(jnp.broadcast_to(column, key.shape), local_pos,
                                             axis=-1)))
    _, pos = lax.top_k(candidates[0], k)
    return (jnp.take_along_axis(candidates[1], pos, axis=-1),
            jnp.take_along_axis(candidates[2], pos, axis=-1).astype(jnp.int32))


# -- the head as one program ----------------------------------------------------------------------


def make_vocab_parallel_head(mesh, param_specs, local_logits, *, order: str,
                             block_sumexp_plan: KernelPlan, argmax_plan: KernelPlan,
                             vocab_size: int, head_columns: int | None = None,
                             axis: str = TENSOR_AXIS):
    """`head(params, hidden [T, H], rows int32[n], token_ids int32[n], *, greedy_targets, k)` ->
    (greedy ids int32[n], token logprobs f32[n], top-k values f32[n, k], top-k ids int32[n, k]),
    each a jitted program under one shard_map over `mesh`, compiled once per (greedy_targets, k).

    greedy_targets: score each row's own greedy id (a greedy step: one program, no host round trip)
    instead of `token_ids`. `local_logits(params, hidden[rows])` must return this rank's
    [n, V_local] logits columns (the LM head without its gather); `param_specs` are the params'
    PartitionSpecs; head_columns (default vocab_size): the LM head's columns, past vocab_size
    zero padding (read as -inf). The block layout is checked here, so a misaligned head is refused
    when it is built, not at its first step."""
    world = dict(mesh.shape)[axis]
    head_columns = vocab_size if head_columns is None else head_columns
    if head_columns % world:
        raise ValueError(f"vocab-parallel head: {head_columns} head columns are not a multiple of "
                         f"the {axis!r} axis size {world}")
    check_block_aligned(order, vocab_size, head_columns // world, world)
    replicated = PartitionSpec()
    programs = {}

    def program(greedy_targets: bool, k: int):
        def head(params, hidden, rows, token_ids):
            local = local_logits(params, hidden[rows])
            greedy = vocab_parallel_argmax(local, axis, local_argmax=argmax_plan,
                                           vocab_size=vocab_size)
            targets = greedy if greedy_targets else token_ids
            logprobs = vocab_parallel_token_logprobs(local, targets, order, block_sumexp_plan,
                                                     axis=axis, vocab_size=vocab_size)
            if k:
                values, ids = vocab_parallel_top_logprobs(local, k, order, block_sumexp_plan,
                                                          axis=axis, vocab_size=vocab_size)
            else:
                values, ids = jnp.zeros((rows.shape[0], 0)), jnp.zeros((rows.shape[0], 0), jnp.int32)
            return greedy, logprobs, values, ids

        # check_vma=False as for the runner's step: the leaves start loops from unvarying values.
        return jax.jit(jax.shard_map(head, mesh=mesh, in_specs=(param_specs,) + (replicated,) * 3,
                                     out_specs=(replicated,) * 4, check_vma=False))

    def call(params, hidden, rows, token_ids, *, greedy_targets: bool = False, k: int = 0):
        key = (bool(greedy_targets), int(k))
        if key not in programs:
            programs[key] = program(*key)
        return programs[key](params, hidden, rows, token_ids)

    return call
