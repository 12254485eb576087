"""Selected-token logprobs: the `block_sumexp` leaves and the one function every consumer calls.

The spec ("Logprobs: one arithmetic for prompt and output") makes `gather_token_logprobs` the only
place a returned logprob is computed, for sampled rows and prompt rows alike, so a token scores the
same number whether it was sampled or teacher-forced. `--logprob-order` picks the arithmetic:

  torch                      (x - max)[t] - log(sum exp(x - max)) over the whole row (fp32 log_softmax)
  blockwise                  -(log(S) - (x - max)[t]), S = fixed 32768-wide blocks folded left to right
  blockwise-direct           (x - max)[t] - log(S), same S
  blockwise-16384            as blockwise, 16384-wide blocks
  blockwise-direct-16384     as blockwise-direct, 16384-wide blocks

The negated form yields -0.0 for a certain token (the trainer's negative cross-entropy); the direct
form yields +0.0. Both use the same reduction.

Any vocabulary size (an extension of the spec's rule, which refuses a vocabulary that is not a whole
number of blocks): the last block is *completed* with -inf logits. Each missing column contributes
exp(-inf) = +0.0, and adding +0.0 to a positive f32 partial is exact, so the fold of the full blocks
plus the completed one is one fixed function of the real logits -- the same in the engine, in the
trainer's twin and, later, in a vocab-parallel head whose shards each hold whole blocks (the last
shard's last block completed the same way). The leaves complete the block themselves (the portable
one pads its exp values with +0.0 inside the jitted program, the Triton one masks its loads with
-inf), so no [rows, padded vocab] copy of the logits is made.

Every reduction whose bits matter is a leaf ("sampling", "block_sumexp"): it receives the logits
already shifted by the row max and returns per-block sums of exp, each block reduced in a fixed tree.
The portable leaf writes that tree as elementwise adds of static slices, so a row's bits depend only
on the row and the static width, never on how many rows share the call (XLA's dot emitter is not row
invariant on CPU or GPU; platform-facts.md). Under `--numerics auto` the XLA-native jnp.sum leaf
ranks higher and is used; it declares no `batch_invariant` feature, so rl-bitwise never selects it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jengine.logprob_orders import LOGPROB_ORDERS
from pallas_kernels._twin import torch_twin
from pallas_kernels.registry import KernelPlan, Priority, declare_family, register


def _block_sumexp_signature(shifted, *, block_size):
    """f32[R, V] logits minus their row max -> f32[R, ceil(V / block_size)] sums of exp per block."""


declare_family("sampling", "block_sumexp", _block_sumexp_signature)


# -- fixed-order building blocks (row-local elementwise work only) --------------------------------


def tree_sum_last(x: jax.Array) -> jax.Array:
    """Sum over the last axis in a fixed halving tree: element i is paired with i + n//2.

    An odd element left over at a level is carried to the next level unchanged, so any width works
    and the tree depends only on the static width. Only elementwise adds of slices: every row's bits
    are independent of the other rows and of the row count.
    """
    while x.shape[-1] > 1:
        n = x.shape[-1]
        h = n // 2
        paired = x[..., :h] + x[..., h : 2 * h]
        x = paired if n % 2 == 0 else jnp.concatenate([paired, x[..., 2 * h :]], axis=-1)
    return x[..., 0]


def inclusive_scan_last(x: jax.Array) -> jax.Array:
    """Prefix sums over the last axis in a fixed Hillis-Steele order (log2(n) shifted adds).

    Element i's value is a tree that depends only on i and the static width. jnp.cumsum is not used
    because its lowering is XLA's choice and may change with shapes.
    """
    n = x.shape[-1]
    shift = 1
    while shift < n:
        pad = jnp.zeros(x.shape[:-1] + (shift,), x.dtype)
        x = x + jnp.concatenate([pad, x[..., : n - shift]], axis=-1)
        shift *= 2
    return x


def canonical_row_max(x: jax.Array) -> jax.Array:
    """Row max [R, 1] with -0.0 mapped to +0.0: max is exact in any order except for signed zeros."""
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.where(m == 0, jnp.zeros_like(m), m)


def num_blocks(vocab: int, block_size: int) -> int:
    """Blocks of a vocabulary, the last one completed with -inf logits when vocab % block_size."""
    return -(-vocab // block_size)


def _check_block(shifted: jax.Array, block_size: int) -> tuple[int, int]:
    if shifted.ndim != 2:
        raise ValueError(f"block_sumexp: shifted must be [rows, vocab], got shape {shifted.shape}")
    rows, vocab = shifted.shape
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_sumexp: block_size={block_size!r} must be a positive integer")
    return rows, num_blocks(vocab, block_size)


def _block_exp(shifted: jax.Array, block_size: int) -> jax.Array:
    """exp of the logits as [rows, blocks, block_size], the last block completed with +0.0
    (= exp(-inf), the value of a missing column)."""
    rows, blocks = _check_block(shifted, block_size)
    e = jnp.exp(shifted.astype(jnp.float32))
    missing = blocks * block_size - shifted.shape[1]
    if missing:
        e = jnp.pad(e, ((0, 0), (0, missing)))
    return e.reshape(rows, blocks, block_size)


# -- the leaves ------------------------------------------------------------------------------------


@register("sampling", "block_sumexp", "fixed_tree", formats={"f32"}, hardware={"any"},
          priority=Priority.PORTABLE, features={"batch_invariant"},
          traits={"deterministic": True, "batch_invariant": True})
def block_sumexp_fixed_tree(shifted: jax.Array, *, block_size: int) -> jax.Array:
    """f32[R, V] logits minus their row max -> f32[R, ceil(V / block_size)] sums of exp per block
    (the last block completed with -inf logits)."""
    return tree_sum_last(_block_exp(shifted, block_size))


@register("sampling", "block_sumexp", "xla_native", formats={"f32"}, hardware={"any"},
          priority=Priority.TUNED + 1, traits={"batch_invariant": False})
def block_sumexp_xla_native(shifted: jax.Array, *, block_size: int) -> jax.Array:
    """XLA's own reduction: fast, run-deterministic, no row-invariance claim (auto only)."""
    return jnp.sum(_block_exp(shifted, block_size), axis=-1)


# The trainer's entry point on the CPU: the same compiled XLA program, called on torch tensors
# through DLPack, so its bits are the JAX leaf's (torch's own exp differs from XLA's on the CPU).
torch_block_sumexp = torch_twin(block_sumexp_fixed_tree, static_argnames=("block_size",))


# -- the one logprob function ----------------------------------------------------------------------


def logprob_block_width(order: str, vocab_size: int) -> int:
    """Block width the order folds over (the whole row for torch). Raises for a bad order."""
    if order not in LOGPROB_ORDERS:
        raise ValueError(f"--logprob-order={order!r} is not one of {list(LOGPROB_ORDERS)}")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r} must be a positive integer")
    width, _ = LOGPROB_ORDERS[order]
    return vocab_size if width is None else width


def block_layout(order: str, vocab_size: int) -> dict:
    """How `order` folds a vocabulary: for /get_server_info and the docs."""
    width = logprob_block_width(order, vocab_size)
    blocks = num_blocks(vocab_size, width)
    last = vocab_size - (blocks - 1) * width
    return {"logprob_order": order, "block_width": width, "vocab_size": vocab_size,
            "blocks": blocks, "last_block_columns": last,
            "last_block_completed_with_neg_inf": width - last}


def fold_block_partials(partials: jax.Array) -> jax.Array:
    """S [R] from the block partials [R, blocks] in vocabulary order: the trainer's rank-ordered
    fold, left to right in fp32. The vocab-parallel head (sharding/vocab_parallel.py) folds the
    partials its shards gathered with this same function, so S does not depend on the shard count."""
    total = partials[:, 0]
    for j in range(1, partials.shape[1]):
        total = total + partials[:, j]
    return total


def _row_log_sum_exp(shifted: jax.Array, order: str, block_sumexp_plan: KernelPlan) -> jax.Array:
    """log(S) [R, 1] with S the order's sum of exp(shifted): block partials, then a left fold."""
    width = logprob_block_width(order, shifted.shape[-1])
    return jnp.log(fold_block_partials(block_sumexp_plan(shifted, block_size=width)))[:, None]


def _row_logprobs(logits: jax.Array, order: str, block_sumexp_plan: KernelPlan):
    """(shifted [R, V], log_s [R, 1], negated?) for `order`; shared by gather and top-k."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {logits.shape}")
    logprob_block_width(order, logits.shape[-1])  # validate before tracing further
    x = logits.astype(jnp.float32)  # bf16 -> f32 is exact
    shifted = x - canonical_row_max(x)
    log_s = _row_log_sum_exp(shifted, order, block_sumexp_plan)
    return shifted, log_s, LOGPROB_ORDERS[order][1]


def finish_logprob(target_shifted: jax.Array, log_s: jax.Array, negated: bool) -> jax.Array:
    # Two spellings of one number that differ in the sign of zero: keep them apart, as the spec says.
    return -(log_s - target_shifted) if negated else target_shifted - log_s


def gather_token_logprobs(logits: jax.Array, token_ids: jax.Array, order: str,
                          block_sumexp_plan: KernelPlan) -> jax.Array:
    """f32[S] logprob of token_ids[s] under row s of logits, in `order`'s arithmetic."""
    shifted, log_s, negated = _row_logprobs(logits, order, block_sumexp_plan)
    ids = jnp.asarray(token_ids, jnp.int32)[:, None]
    target = jnp.take_along_axis(shifted, ids, axis=-1)
    return finish_logprob(target, log_s, negated)[:, 0]


def top_logprobs(logits: jax.Array, k: int, order: str,
                 block_sumexp_plan: KernelPlan) -> tuple[jax.Array, jax.Array]:
    """The k largest entries of each row's logprob vector (same arithmetic as the gather).

    Ties resolve toward the lowest token id, with -0.0 and +0.0 one key; NaN ranks above every
    number (lax.top_k's order). The returned value is gathered from the unmodified row, so an
    alternative's value equals `gather_token_logprobs` of that token bit for bit.
    """
    if not 0 <= k <= logits.shape[-1]:
        raise ValueError(f"top_logprobs: k={k} must be in [0, vocab_size={logits.shape[-1]}]")
    shifted, log_s, negated = _row_logprobs(logits, order, block_sumexp_plan)
    values = finish_logprob(shifted, log_s, negated)
    key = jnp.where(values == 0, jnp.zeros_like(values), values)  # one key for both zeros
    _, ids = jax.lax.top_k(key, k)  # documented: equal keys keep the lower index first
    return jnp.take_along_axis(values, ids, axis=-1), ids.astype(jnp.int32)
