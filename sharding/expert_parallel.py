"""Expert parallelism as a MoE block sees it: tokens dispatched to their experts' owners and
combined back by all-to-all, bytes only.

With --ep-size E the stacked expert weights [num_experts, ...] are split over the mesh's "expert"
axis (sharding/rules.py): rank r holds experts [r * n_local, (r + 1) * n_local). Everything else is
whole on every rank, so every rank holds every token row and routes it identically. A MoE layer
(`ExpertParallel.combine`):

    rows      rank r takes its share of the step's rows: T padded to a multiple of E, T/E rows
              each (slicing replicated activations is free)
    dispatch  each (row, slot) pair is packed for the rank owning its expert into a static send
              buffer [E (destination), C, H], C = T/E * k; one all-to-all (and two small ones for
              the pairs' local expert ids and routing weights)
    experts   the received rows through this rank's experts (the MoE block's routed path: the
              ("moe", "grouped_gemm") leaf, each row with the bits that leaf gives it alone, so
              how rows are grouped never changes a row)
    return    one all-to-all back: each pair's output lands in its row's rank, where it was packed
    fold      each row's k outputs folded in f32 by the caller's fold (slot order, as one device
              does; or `rank`, below), rounded once
    gather    the [T/E, H] outputs all-gathered (tiled) to every rank

Every step moves bytes; the arithmetic on a pair is the one-device arithmetic on the same operands,
so a token's output bits do not depend on the EP size (EP1 = EP2 = EP4 = EP8;
tests/test_expert_parallel.py).

`--moe-combine-order rank` is the other fold: a row's slots owned by each rank are added in slot
order into an f32 partial and the partials are folded in rank order (`rank_order_sum`). Its
association follows the placement, so it is batch-invariant but not EP-size invariant (the tests'
negative control).

Traffic per MoE layer, received by each rank (b bytes per element):

    all-to-all dispatch + return   2 x (E - 1) x C x H x b      C = T/E * k
    all-gather of the outputs      (E - 1) x T/E x H x b
    total                          (E - 1)/E x T x (2k + 1) x H x b  (+ the ids and weights)

The all-gather of every rank's slot outputs this replaced received (E - 1) x T x k x H x b, about
E/2 times as much: per token, in rows of H, k vs k + 1/2 at E = 2 (the one size where the
all-gather moved less), 3k vs 1.5k + 0.75 at E = 4, 7k vs 1.75k + 0.875 at E = 8.

Why a static capacity: C is the worst case, every pair of a rank's rows routed to one owner, so no
token is ever dropped and every shape is static. A buffer moves C rows whatever the routing; on
average only C / E of them carry a pair. `lax.ragged_all_to_all` would move the routed rows only,
but XLA's CPU backend does not implement it ("HLO opcode `ragged-all-to-all` is not supported by
XLA:CPU ThunkEmitter", jax 0.10.2), and the fake-device tests run there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax

from sharding.collectives import rank_order_fold
from sharding.mesh import EXPERT_AXIS


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    size: int
    axis: str = EXPERT_AXIS

    def combine(self, x, slots, weights, n_local: int, experts: Callable, fold: Callable):
        """Every row's experts' output [T, H] on every rank (inside the step's shard_map).

        x [T, H], slots int32[T, k] (each slot's global expert), weights [T, k]: the same on every
        rank. experts(rows [R, H], local_ids int32[R], weights [R]) -> [R, H]: this rank's experts
        on the rows it received; an id of n_local marks an empty row (its output is unused).
        fold(outputs [rows, k, H], slots int32[rows, k]) -> [rows, H]: a row's k slot outputs,
        combined; its dtype is what the all-gather moves."""
        t, k = slots.shape
        e = self.size
        rows = -(-t // e)
        rank = lax.axis_index(self.axis)

        def share(a, fill):  # this rank's rows of a replicated [T, ...] array, padded to rows * E
            a = jnp.pad(a, [(0, rows * e - t)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
            return lax.dynamic_slice_in_dim(a, rank * rows, rows)

        my_slots = share(slots, e * n_local)  # a padding row's pairs go to rank E: nowhere
        owner = (my_slots // n_local).reshape(rows * k)       # pair p = row * k + slot
        place = _place_in_buffer(owner, e)
        pair_row = jnp.arange(rows * k) // k
        # mode="drop": a padding pair's owner E is outside the buffer, so it is never written.
        send_x = jnp.zeros((e, rows * k, x.shape[1]), x.dtype).at[owner, place].set(
            share(x, 0)[pair_row], mode="drop")
        send_id = jnp.full((e, rows * k), n_local, jnp.int32).at[owner, place].set(
            (my_slots % n_local).reshape(rows * k), mode="drop")
        send_w = jnp.zeros((e, rows * k), weights.dtype).at[owner, place].set(
            share(weights, 0).reshape(rows * k), mode="drop")

        def all_to_all(a):  # out[s] = what rank s packed for this rank
            return lax.all_to_all(a, self.axis, split_axis=0, concat_axis=0, tiled=True)

        got_x, got_id, got_w = all_to_all(send_x), all_to_all(send_id), all_to_all(send_w)
        done = experts(got_x.reshape(-1, x.shape[1]), got_id.reshape(-1), got_w.reshape(-1))
        back = all_to_all(done.reshape(send_x.shape))  # back[d] = rank d's outputs of my pairs
        outputs = back.at[owner, place].get(mode="fill", fill_value=0).reshape(rows, k, -1)
        mine = fold(outputs, my_slots)
        everyone = lax.all_gather(mine, self.axis, axis=0, tiled=True, to="invarying")
        return everyone[:t]

    def rank_order_sum(self, outputs, slots, n_local: int):
        """`--moe-combine-order rank`: f32 [rows, H], each rank's owned slots of `outputs` [rows,
        k, H] added in slot order into a partial, the E partials folded in rank order."""
        owner = slots // n_local
        partials = []
        for rank in range(self.size):
            partial = jnp.zeros(outputs.shape[::2], jnp.float32)
            for s in range(slots.shape[1]):
                partial = partial + jnp.where(owner[:, s, None] == rank,
                                              outputs[:, s].astype(jnp.float32), 0.0)
            partials.append(partial)
        return rank_order_fold(jnp.stack(partials))


def _place_in_buffer(owner, e: int):
    """int32[P]: pair p's row in its owner's send buffer -- the number of earlier pairs with the
    same owner, so each owner's pairs fill rows 0, 1, ... in pair order (an owner of E: 0)."""
    hit = owner[:, None] == jnp.arange(e)[None, :]                   # [P, E]
    before = jnp.cumsum(hit, axis=0, dtype=jnp.int32) - 1
    return jnp.where(hit, before, 0).sum(axis=1)
