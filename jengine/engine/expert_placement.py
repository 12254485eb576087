"""EPLB's runtime state in the runner (`--enable-eplb`): the current placement of every MoE layer,
the load measured since the last rebalance, and where each layer's map and expert weights sit in
the runner's flat parameter tuple.

sharding/eplb.py holds the pure functions (placements, the greedy balance, the slot gather, the
load count) and says why a rebalance moves no bit; `ExpertPlacementState` is the one place that
remembers between steps. The runner holds one (`ModelRunner.eplb`, None without --enable-eplb),
counts each step's routed ids into it, and swaps in the parameters a rebalance returns.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from jengine.launch import EPLBOptions
from sharding import eplb

# A MoE layer's placement map or expert weights in the flat parameter tuple
_MOE_LEAF = re.compile(r"\['layers'\]\[(\d+)\]\['mlp'\]\['(physical_to_logical|experts)'\]")


class ExpertPlacementState:
    def __init__(self, options: EPLBOptions, model_config, ranks: int):
        """options: the launch's EPLB part; ranks: the expert-parallel size the slots split over."""
        self.options = options
        self.ranks = ranks
        self.num_layers = model_config.num_hidden_layers
        self.num_experts = model_config.num_experts
        # each MoE layer's physical_to_logical map, int32[layers, P]; the model is built with it
        self.placement = eplb.initial_placement(
            options.init_location, layers=self.num_layers, num_experts=self.num_experts,
            num_physical=options.num_physical)
        self.slots: dict[int, list] = {}  # layer -> [index of its map, indices of its 3 weights]
        self.rebalances = 0
        self._count_load = jax.jit(eplb.count_load)
        self._reset_load()

    def locate(self, paths) -> None:
        """Find each MoE layer's map and expert weights among the flat parameters' key paths
        (`jax.tree_util.keystr` of the model state's leaves, in the tuple's order)."""
        for i, path in enumerate(paths):
            m = _MOE_LEAF.match(path)
            if m:
                layer = self.slots.setdefault(int(m.group(1)), [None, []])
                if m.group(2) == "physical_to_logical":
                    layer[0] = i
                else:
                    layer[1].append(i)

    def _reset_load(self) -> None:
        self._load = jnp.zeros((self.num_layers, self.num_experts), jnp.int32)
        self.steps = 0

    # -- the step ----------------------------------------------------------------------------------
    def rebalance_due(self) -> bool:
        """Whether --eplb-rebalance-num-iterations steps have run since the last rebalance."""
        interval = self.options.rebalance_interval
        return bool(interval) and self.steps >= interval

    def count(self, routed: jax.Array, num_tokens: int) -> None:
        """Add a step's routed ids (int32[T_pad, layers, k], the first num_tokens rows real) to the
        load, on the device: nothing here waits for the step."""
        self._load = self._count_load(self._load, routed, np.int32(num_tokens))
        self.steps += 1

    def load(self) -> np.ndarray:
        """Routed (row, slot) pairs per logical expert, int[layers, E], since the last rebalance."""
        return np.asarray(self._load)

    def report(self) -> dict:
        """What /get_server_info shows of EPLB (`RunnerPlacement.report`)."""
        return {"physical_experts": self.options.num_physical, "rebalances": self.rebalances}

    # -- moving experts ----------------------------------------------------------------------------
    def rebalance(self, params: tuple, placement=None) -> tuple[tuple, dict]:
        """Move each MoE layer to `placement` (int32[layers, P]; default: `balanced_placement` of
        the measured load). Returns the parameter tuple to serve -- new arrays of the old shapes
        and placements: the slots' weights re-gathered on the device, the maps swapped in -- and
        the report {"load", "physical_to_logical"}; the load restarts from zero."""
        load = self.load()
        if placement is None:
            placement = self.placement.copy()
            for layer in self.slots:
                placement[layer] = eplb.balanced_placement(load[layer], self.options.num_physical,
                                                           self.ranks)
        params = list(params)
        for layer, (map_index, weights) in self.slots.items():
            new = eplb.check_placement(placement[layer], self.num_experts,
                                       self.options.num_physical, f"layer {layer}")
            src = eplb.source_slots(self.placement[layer], new)
            for i in weights:
                params[i] = eplb.gather_slots(params[i], src)
            params[map_index] = jax.device_put(new, params[map_index].sharding)
        self.placement = np.asarray(placement, np.int32)
        self.rebalances += 1
        self._reset_load()
        return tuple(params), {"load": load.tolist(),
                               "physical_to_logical": self.placement.tolist()}

    def logical_experts(self, named: dict) -> None:
        """Each MoE layer's held experts in `named` (physical slots, [P, ...]) -> the logical
        [E, ...] weights its specs declare: expert e from its first slot (every replica holds the
        same bytes). What a partial update keeps must be logical: the rebuilt model gathers its
        slots from it again, by the current placement (`SparseMoE.place_experts`)."""
        logical = np.arange(self.num_experts, dtype=np.int32)
        for layer in self.slots:
            src = eplb.source_slots(self.placement[layer], logical)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                path = f"layers.{layer}.mlp.experts.{proj}"
                named[path] = eplb.gather_slots(named[path], src)
