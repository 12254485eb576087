"""A sparse MoE block (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`): a router, stacked SwiGLU experts and
the slot-order combine.

    router logits = gemm(x, router)                 model dtype, as HF's bf16 F.linear
    ids, weights  = router_topk(logits as f32, k)   the ("moe", "router_topk") plan
    weights       -> model dtype                     HF: router_top_value.to(router_logits.dtype)
    a_e           = silu(gate_e(x)) * up_e(x)        model dtype
    y_e           = down_e(a_e * w_e)                the routing weight INSIDE the activation
    out           = sum over slots s = 0..k-1 of y_{ids[s]}, in f32, rounded once

Only the routed (token, slot) pairs are computed (`--moe-backend batch_invariant`, the rl-bitwise
one): the pairs are sorted by expert into one-expert tiles and run through the ("moe",
"grouped_gemm") plan (jengine/models/layers/moe_routed.py), whose every row has the bits the gemm
leaf gives that row alone. So a row's bits never depend on how many tokens an expert got (group
sizes change the number of tiles, never a row's reduction), and the block is batch invariant
exactly when its GEMM and router leaves are. `--moe-backend portable` runs every expert on every
row as one XLA einsum per projection (E/k times the routed FLOPs; no batch-invariance claim).

Where the routing weight scales: inside the activation, before down_proj, as the spec's slot form
and a grouped-MLP trainer (Megatron's weighted SwiGLU) apply it: `a * w` is one product rounded
to the model dtype (a bf16 x bf16 product is exact in f32, so computing it in f32 and rounding
once gives the same bits). down_proj then sees the weighted activation, so a slot's output is
already scaled and the combine adds unscaled terms. HF's eager `Qwen3MoeExperts.forward` scales
after down_proj instead (a different rounding point); trainer mode runs this form.

The combine: `--moe-combine-order slot` folds a token's k scaled outputs in f32 in slot order, one
rounding. On one device `rank` has a single rank's partial, which is the same fold, so both give the
same bits here. Under --ep-size each (token, slot) pair travels to its expert's owner and back by
all-to-all (sharding/expert_parallel.py); `slot` then folds exactly as on one device (EP-size
invariant), while `rank` folds per-rank partials in rank order.
Under --enable-eplb the stacked experts are physical slots (a logical expert may have replicas) and
a token's logical ids are dispatched to slots by the layer's `physical_to_logical` map, a step
parameter (sharding/eplb.py); the routed ids exported stay logical.
HF differs in summation order: eager adds the k terms in ascending EXPERT id into a running sum in
the model dtype (a rounding per add); the default `grouped_mm` path sums slots in f32 with four
interleaved accumulators (`(((w0+w4)+(w1+w5))+(w2+w6))+(w3+w7)` for k = 8, reference notes 5.4).
Neither is slot order, so against stock HF the combine agrees within rounding, not bitwise; trainer
mode replaces HF's experts forward with this block's path and fold (interop/trainer_mode.py), which
aligns bitwise (tests/test_moe_align.py).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from sharding import eplb

from jengine.models.layers.linear import Linear
from jengine.models.layers.moe_routed import routed_expert_outputs
from jengine.models.layers.param import ParamSpec


class SparseMoE(nnx.Module):
    @staticmethod
    def specs(cfg, *, dtype) -> dict[str, dict]:
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size

        def experts(shape, axes):  # stored one [out, in] tensor per expert, held [E, in, out]
            return ParamSpec(shape, dtype, axes, transpose=True, stacked=e)

        return {"gate": Linear.specs(h, e, ("embed", "router_expert"), bias=False, dtype=dtype),
                "experts": {"gate_proj": experts((e, h, i), ("expert", "embed", "expert_mlp")),
                            "up_proj": experts((e, h, i), ("expert", "embed", "expert_mlp")),
                            "down_proj": experts((e, i, h), ("expert", "expert_mlp", "embed"))}}

    def __init__(self, cfg, specs: dict, source):
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Linear(specs["gate"], source)
        self.experts = _Experts(specs["experts"], source)
        # sharding.expert_parallel.ExpertParallel under --ep-size (set by the MoE body), else None
        self.ep = None
        # Under --enable-eplb the experts are physical slots and this is their map (place_experts)
        self.physical_to_logical = None

    def place_experts(self, p2l) -> None:
        """Hold the physical slots of the map int32[P] (sharding/eplb.py): slot j = logical
        expert p2l[j]'s weights, gathered from the logical ones on their own sharding."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            param = getattr(self.experts, name)
            param.value = eplb.gather_slots(param[...], jnp.asarray(p2l, jnp.int32))
        self.physical_to_logical = nnx.data(nnx.Variable(jnp.asarray(p2l, jnp.int32)))

    def __call__(self, kern, x, *, dtype, tp=None):
        """x [T, H] -> [T, H] in `dtype`. kern: the MoE body's kernel set (router_topk plan)."""
        return self.routed(kern, x, dtype=dtype, tp=tp)[0]

    def routed(self, kern, x, *, dtype, tp=None, padding=None):
        """(the block's output [T, H] in `dtype`, the expert ids int32[T, k] it routed each row
        to): the ids are what --return-routed-experts exports (docs/serving.md). padding: bool[T]
        or None, the step bucket's padding rows (see `combine`)."""
        if tp is not None:
            raise ValueError("tensor parallelism of a MoE block is not implemented (MoE TP = 1; "
                             "split the experts with --ep-size instead)")
        ids, weights = self.route(kern, x, dtype=dtype)
        return self.combine(kern, x, ids, weights, dtype=dtype, padding=padding), ids

    def combine(self, kern, x, ids, weights, *, dtype, identity=None, padding=None):
        """The experts' output [T, H] in `dtype` for the routing (ids int32[T, k], weights [T, k]
        in `dtype`): each slot's expert with its weight inside the activation, folded in slot order.
        identity: bool [T, k] or None -- slots routed to an identity (zero) expert (LongCat-Flash):
        their term is x * weight rounded to `dtype` (an identity expert's weighted activation), their
        ids are placeholders and they reach no expert. Not under --ep-size.
        padding: bool [T] or None -- rows that only pad the step's token bucket (a bs 1 decode step
        runs 16 rows, 15 of them padding, all routed alike). Their pairs reach no expert and their
        output is zeros: a padding row's hidden state is never read (its KV write is dropped), and
        a row's bits never depend on which other pairs share the experts' tiles
        (moe_grouped_gemm.py), so this changes no real row's bits while it spares the routed
        path the padding rows' experts -- up to k more experts' weights read per layer. Under
        --ep-size padding pairs still travel (sharding/expert_parallel.py)."""
        if identity is not None and self.ep is not None:
            raise ValueError("identity (zero) experts under expert parallelism are not "
                             "implemented (the residual must enter exactly one rank's partial)")
        slots = ids                                               # the experts computing each slot
        if self.physical_to_logical is not None:  # EPLB: a replica of each logical expert
            slots = eplb.dispatch(ids, self.physical_to_logical[...])
        n_local = self.experts.gate_proj.shape[0]                 # this rank's (physical) experts
        if self.ep is not None:
            return self._combine_expert_parallel(kern, x, slots, weights, n_local, dtype=dtype)
        local = slots
        if identity is not None:  # no expert computes an identity slot: out of the experts' range
            local = jnp.where(identity, n_local, local)
        if padding is not None:  # nor a padding row's
            local = jnp.where(padding[:, None], n_local, local)
        mine = self.experts(kern, x, local, weights, dtype=dtype,
                            foreign=identity is not None or padding is not None)  # [T, k, H]
        if identity is not None:
            residual = (x[:, None, :] * weights[:, :, None]).astype(dtype)  # one product, rounded
            mine = jnp.where(identity[:, :, None], residual, mine)
        return slot_order_sum(mine).astype(dtype)

    def _combine_expert_parallel(self, kern, x, slots, weights, n_local: int, *, dtype):
        """`combine` under --ep-size: each (row, slot) pair sent to its expert's owner and back by
        all-to-all (sharding/expert_parallel.py), through the same expert path, folded in slot
        order as on one device (`rank`: per-rank partials in rank order)."""
        def experts(rows, local, row_weights):  # the rows this rank received, k = 1 each
            return self.experts(kern, rows, local[:, None], row_weights[:, None], dtype=dtype,
                                foreign=True)[:, 0]

        def fold(outputs, owned_slots):
            if kern.combine_order == "rank":
                return self.ep.rank_order_sum(outputs, owned_slots, n_local).astype(dtype)
            return slot_order_sum(outputs).astype(dtype)

        return self.ep.combine(x, slots, weights, n_local, experts, fold)

    def route(self, kern, x, *, dtype):
        """(expert ids int32[T, k], routing weights [T, k] in `dtype`) for the rows of x."""
        logits = self.gate(kern, x, out_dtype=dtype)
        ids, weights = kern.router_topk(logits.astype(jnp.float32), k=self.top_k,
                                        norm_topk_prob=self.norm_topk_prob)
        return ids, weights.astype(dtype)


def expert_row_weights(local_ids, weights, n_local: int):
    """[n_local, T]: row t of expert e carries the weight token t routed to e (local_ids int32[T, k]
    are ids relative to this rank's first expert), 0 where t did not route to e. A token routes to
    an expert at most once, so each entry is one weight or an exact 0 (no arithmetic on weights)."""
    experts = jnp.arange(n_local)[:, None, None]                        # [n_local, 1, 1]
    hit = local_ids[None, :, :] == experts                              # [n_local, T, k]
    return jnp.where(hit, weights[None], jnp.zeros((), weights.dtype)).sum(axis=-1)


def slot_order_sum(terms):
    """[T, k, H] -> f32 [T, H]: terms widened to f32 and added in slot order 0, 1, ..., k-1."""
    acc = terms[:, 0].astype(jnp.float32)
    for s in range(1, terms.shape[1]):
        acc = acc + terms[:, s].astype(jnp.float32)
    return acc


class _Experts(nnx.Module):
    """Stacked SwiGLU experts: gate_proj, up_proj [E, H, I] and down_proj [E, I, H]."""

    def __init__(self, specs: dict, source):
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, name, nnx.Param(source.place(specs[name])))

    def __call__(self, kern, x, local_ids, weights, *, dtype, foreign: bool = False):
        """[T, k, H] in `dtype`: slot (t, s) is expert local_ids[t, s]'s output for row t, its
        activation scaled by weights[t, s]. With `foreign` an id outside [0, E) is a slot no expert
        here computes (an empty row of an expert-parallel buffer, an identity expert's slot): it
        is zeros and costs no GEMM work.

        batch_invariant: only the routed pairs, through the ("moe", "grouped_gemm") plan
        (jengine/models/layers/moe_routed.py): each pair's row has the bits the gemm leaf gives
        it, whatever the routing. portable: one XLA einsum per projection over the stacked
        experts on every row (--moe-backend portable; never under rl-bitwise)."""
        gate_w, up_w, down_w = self.gate_proj[...], self.up_proj[...], self.down_proj[...]
        n = gate_w.shape[0]
        owned = (local_ids >= 0) & (local_ids < n)
        if kern.expert_backend != "portable":
            return routed_expert_outputs(kern, x, jnp.where(owned, local_ids, n), weights,
                                         gate_w, up_w, down_w, dtype=dtype, foreign=foreign)

        def einsum(spec, a, b):
            return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(dtype)

        row_weights = expert_row_weights(local_ids, weights, n)                    # [E, T]
        hidden = kern.silu(einsum("th,ehi->eti", x, gate_w),
                           times=einsum("th,ehi->eti", x, up_w))
        per_expert = einsum("eti,eih->eth", hidden * row_weights[:, :, None], down_w)
        rows = jnp.arange(x.shape[0])[:, None]
        mine = per_expert[jnp.clip(local_ids, 0, n - 1), rows]
        return jnp.where(owned[:, :, None], mine, jnp.zeros((), dtype))
