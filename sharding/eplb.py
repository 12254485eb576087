"""EPLB (expert-parallel load balancing, `--enable-eplb`): redundant expert slots and a placement
that follows the measured load, without recompiling the step and without moving an output bit.

Under `--ep-size N --ep-num-redundant-experts R` each MoE layer holds P = E + R *physical* expert
slots (P % N == 0), rank r the slots [r * P/N, (r + 1) * P/N). A layer's placement is its
`physical_to_logical` map int32[P]: the logical expert each slot holds, every logical expert at
least once. The map is a parameter of the step program (an argument, like the weights), so a
rebalance is new arrays of the same shapes: the map, and the slots' weights re-gathered on the
device from the slots that already hold each logical expert (bytes copied, no arithmetic).

Dispatch: a token row routed to logical expert e takes replica `row % count(e)` of e's slots (in
slot order) -- a pure function of (row, e, map). Every replica holds the same bytes and every slot
runs on every row (jengine/models/layers/moe.py), so which replica serves a row moves no bit: with
the slot-order combine a rebalance changes no output bit (tests/test_eplb.py). The rank-order
combine folds per-rank partials, whose association follows the placement: its bits change.

The load is the number of routed (row, slot) pairs per logical expert per layer, counted on the
device from the ids the step already exports, since the last rebalance. `balanced_placement`:
  1. replicas: each logical expert gets one slot; each of the R redundant slots goes, one at a
     time, to the expert with the largest load per replica (ties: the lowest expert id);
  2. ranks: the replicas, heaviest per-replica load first (ties: lower expert id), each go to the
     rank with the least load so far among those with a free slot (ties: the lowest rank); within
     a rank the slots are in that order.
The initial placement (`--init-expert-location trivial`) is slot j -> expert j % E; a JSON file
instead gives {"physical_to_logical": [[...P ids...] per layer]} or one list for every layer.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np


def trivial_placement(num_experts: int, num_physical: int) -> np.ndarray:
    return np.arange(num_physical, dtype=np.int32) % num_experts


def check_placement(p2l, num_experts: int, num_physical: int, what: str) -> np.ndarray:
    """p2l as int32[P], or ValueError naming `what` and the fault."""
    p2l = np.asarray(p2l)
    if p2l.shape != (num_physical,) or not np.issubdtype(p2l.dtype, np.integer):
        raise ValueError(f"{what}: physical_to_logical must be {num_physical} integers, got "
                         f"shape {p2l.shape} {p2l.dtype}")
    if p2l.min() < 0 or p2l.max() >= num_experts:
        raise ValueError(f"{what}: expert ids must lie in [0, {num_experts}), got "
                         f"[{p2l.min()}, {p2l.max()}]")
    missing = sorted(set(range(num_experts)) - set(p2l.tolist()))
    if missing:
        raise ValueError(f"{what}: logical experts {missing} have no physical slot")
    return p2l.astype(np.int32)


def initial_placement(location: str, *, layers: int, num_experts: int,
                      num_physical: int) -> np.ndarray:
    """int32[layers, P] from --init-expert-location: 'trivial' or a JSON file's path."""
    if location == "trivial":
        return np.tile(trivial_placement(num_experts, num_physical), (layers, 1))
    what = f"--init-expert-location {location}"
    try:
        with open(location) as f:
            maps = json.load(f)["physical_to_logical"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{what}: not a JSON file with a 'physical_to_logical' list ({exc})") \
            from None
    if maps and not isinstance(maps[0], list):
        maps = [maps] * layers
    if len(maps) != layers:
        raise ValueError(f"{what}: {len(maps)} layer maps for {layers} layers")
    return np.stack([check_placement(m, num_experts, num_physical, f"{what} layer {i}")
                     for i, m in enumerate(maps)])


def balanced_placement(load, num_physical: int, ranks: int) -> np.ndarray:
    """The greedy placement (module docstring) of one layer: load int[E] -> int32[P]."""
    load = np.asarray(load, np.float64)
    e = len(load)
    count = np.ones(e, np.int64)
    for _ in range(num_physical - e):
        count[np.argmax(load / count)] += 1  # argmax: the first (lowest id) of equal maxima
    replicas = sorted(((load[x] / count[x], x) for x in range(e) for _ in range(count[x])),
                      key=lambda r: (-r[0], r[1]))
    per_rank = num_physical // ranks
    slots = [[] for _ in range(ranks)]
    totals = np.zeros(ranks)
    for share, expert in replicas:
        rank = min((r for r in range(ranks) if len(slots[r]) < per_rank), key=lambda r: totals[r])
        slots[rank].append(expert)
        totals[rank] += share
    return np.asarray([x for rank in slots for x in rank], np.int32)


def source_slots(old_p2l: np.ndarray, new_p2l: np.ndarray) -> np.ndarray:
    """For each new slot, an old slot holding the same logical expert (its first)."""
    first = {}
    for slot, expert in enumerate(old_p2l.tolist()):
        first.setdefault(expert, slot)
    return np.asarray([first[x] for x in new_p2l.tolist()], np.int32)


@jax.jit
def gather_slots(weights, src):
    """weights [slots, ...] -> [len(src), ...]: slot j = weights[src[j]], on the same sharding
    (the experts' split over the "expert" axis). Bytes copied, no arithmetic."""
    return weights.at[src].get(out_sharding=jax.typeof(weights).sharding)


def dispatch(ids, p2l):
    """Logical ids int32[T, k] -> physical slots int32[T, k]: replica `row % count` of each
    expert's slots, in slot order (traced; p2l int32[P] is a runtime input)."""
    holds = p2l[None, None, :] == ids[:, :, None]                       # [T, k, P]
    count = holds.sum(-1)
    row = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None]
    want = row % jnp.maximum(count, 1)
    nth = jnp.cumsum(holds, axis=-1) - 1                                 # replica index per slot
    return jnp.argmax(holds & (nth == want[:, :, None]), axis=-1).astype(jnp.int32)


def count_load(load, routed, num_tokens):
    """load int32[layers, E] + the (row, slot) pairs of routed int32[T_pad, layers, k] among the
    first num_tokens rows (dense layers' -1 ids count nowhere)."""
    layers, e = load.shape
    valid = (jnp.arange(routed.shape[0]) < num_tokens)[:, None, None] & (routed >= 0)
    hits = (routed[..., None] == jnp.arange(e)) & valid[..., None]       # [T, layers, k, E]
    return load + hits.sum(axis=(0, 2)).astype(load.dtype)
