"""Expert parallelism as a MoE block sees it: this rank's share of the experts, and the combine.

With --ep-size E the stacked expert weights [num_experts, ...] are split over the mesh's "expert"
axis (sharding/rules.py): rank r holds experts [r * n_local, (r + 1) * n_local). Everything else is
whole on every rank, so every rank routes every token identically. A rank computes its own experts'
outputs; each token's k slot outputs are then moved from their owners by an all-gather and a
selection -- bytes, no arithmetic -- and folded in slot order exactly as on one device. So a token's
output bits do not depend on the EP size (EP1 = EP2 = EP4 = EP8; tests/test_expert_parallel.py).

`--moe-combine-order rank` is the other combine: each rank folds the slots it owns (in slot order)
into an f32 partial and the partials are folded in rank order. Its association follows the
placement, so it is batch-invariant but not EP-size invariant (the tests' negative control).

Traffic: each rank receives (E - 1) x [T, k, H] per MoE layer (every token's k slots from every
rank, of which it keeps the owner's); an all-to-all dispatch would move only the routed rows.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from sharding.collectives import rank_order_fold
from sharding.mesh import EXPERT_AXIS


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    size: int
    axis: str = EXPERT_AXIS

    def first_expert(self, n_local: int):
        """The global id of this rank's first expert (inside the step's shard_map)."""
        return lax.axis_index(self.axis) * n_local

    def slot_outputs(self, mine, ids, n_local: int):
        """mine [T, k, H]: the slots this rank computed (its own experts'; others arbitrary);
        ids int32[T, k]: each slot's global expert. -> [T, k, H]: every slot taken from the rank
        that owns its expert (an all-gather and a selection: bytes, no arithmetic)."""
        rows = jnp.arange(ids.shape[0])[:, None]
        parts = lax.all_gather(mine, self.axis, axis=0, tiled=False, to="invarying")  # [E, T, k, H]
        slots = jnp.arange(ids.shape[1])[None, :]
        return parts[ids // n_local, rows, slots]

    def rank_combine(self, mine, ids, n_local: int):
        """`--moe-combine-order rank`: f32 [T, H], each rank's owned slots of `mine` (weighted
        expert outputs) added in slot order into a partial, the partials folded in rank order."""
        first = self.first_expert(n_local)
        owned = (ids >= first) & (ids < first + n_local)
        partial = jnp.zeros(mine.shape[::2], jnp.float32)
        for s in range(ids.shape[1]):
            partial = partial + jnp.where(owned[:, s, None], mine[:, s].astype(jnp.float32), 0.0)
        return rank_order_fold(lax.all_gather(partial, self.axis, axis=0, tiled=False,
                                              to="invarying"))
