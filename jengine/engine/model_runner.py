"""The model runner: weights, the paged KV pool, and the jitted step over fixed shape buckets.

It knows models only through the registry (jengine/models/registry.py): the family builds the
model from a weight source, plans its kernels, and declares the KV cache spec the pool is
allocated from (jengine/models/kv_cache.py).

The scheduler hands over a `StepBatch` of exact sizes; the runner pads it to a (tokens, pages)
bucket so the number of compiled programs stays small, runs the jitted forward with the KV pool
donated (updated in place), and returns the hidden states of the rows the caller asked for.
Padding rows point at the null page, their K/V writes are dropped, and real rows never read it, so
padding cannot change a real row's bits.

With tp_size > 1 the runner builds a mesh of that many devices, places every parameter from its
ParamSpec's logical axes through the tensor_parallel rules (sharding/rules.py), shards the KV pool
on kv_heads, and runs the whole step -- and the LM head -- under one `jax.shard_map`: the model
computes on its local shards and talks to other ranks only at the call sites of
sharding/tensor_parallel.py. With tp_size == 1 none of this is built: the step is today's program.

A data-parallel replica passes its own `devices` (sharding.mesh.replica_devices): the mesh is
built from them, or at tp_size == 1 the parameters and the KV pool are committed to that one
device, so every jitted program runs there. Without `devices`, the default device as before.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from tqdm import tqdm

from jengine.engine.batch import StepBatch, fill_placeholders
from jengine.engine.kv_pool import KVPool
from jengine.launch import RunnerConfig
from jengine.models.kv_cache import NULL_PAGE, KVPages
from jengine.models.layers.param import OverlaySource, weight_source
from jengine.models.registry import get_family
from pallas_kernels.fixed_order import next_pow2
from sharding.mesh import make_mesh
from sharding.rules import check_divisible, layout_for, logical_to_spec, param_placement, rules_for
from sharding import eplb
from sharding.expert_parallel import ExpertParallel
from sharding.tensor_parallel import TensorParallel, head_padding, kv_head_replicas
from sharding.vocab_parallel import make_vocab_parallel_head

logger = logging.getLogger(__name__)

MIN_TOKEN_BUCKET = 16
# A MoE layer's placement map or expert weights in the flat parameter tuple (EPLB)
_MOE_LEAF = re.compile(r"\['layers'\]\[(\d+)\]\['mlp'\]\['(physical_to_logical|experts)'\]")
MIN_LOGIT_BUCKET = 8

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


class ModelRunner:
    def __init__(self, model_config, weights, cfg: RunnerConfig, devices: tuple | None = None):
        """model_config: the checkpoint's ModelConfig, already checked against the launch
        (jengine.launch.plan_launch). weights: a checkpoint reader (LoadedModel.checkpoint), a
        mapping of HF tensor name -> array, or a weight source such as RandomSource (the bench).
        cfg: the runner's part of the launch plan. devices: this runner's device group (a
        data-parallel replica's); None = jax's default device, or the first tp_size devices."""
        self.model_config = model_config
        self.family = get_family(model_config.architecture)
        self.options = cfg.model
        self.dtype = jnp.dtype(_DTYPES[cfg.model.dtype])
        self.kernels = self.family.plan_kernels(dtype=self.dtype, hardware=cfg.model.hardware,
                                                features=cfg.model.required_features,
                                                head_dim=model_config.head_dim,
                                                kv_lora_rank=model_config.kv_lora_rank,
                                                moe=cfg.model.moe)
        logger.info("kernel plans: %s", self.kernels.describe())
        self.mesh = self._placement = self._tp = self._ep = self._device = self._home = None
        self._kv_head_replicas = 1
        if cfg.tp_size == 1 and cfg.ep_size == 1 and devices is not None:
            # A replica's model is built on its own device (never staged on the default one),
            # then committed there.
            self._home = devices[0]
            self._device = SingleDeviceSharding(self._home)
        if cfg.tp_size > 1 or cfg.ep_size > 1:
            self.mesh = make_mesh(tp=cfg.tp_size, ep=cfg.ep_size, devices=devices)
            self._rules = rules_for(layout_for(cfg.tp_size, cfg.tp_batch_invariant))
        if cfg.ep_size > 1:
            self._ep = ExpertParallel(cfg.ep_size)
        if cfg.tp_size > 1:
            self._kv_head_replicas = kv_head_replicas(model_config.num_attention_heads,
                                                      model_config.num_key_value_heads,
                                                      cfg.tp_size)
            if self._kv_head_replicas > 1:
                self._rules = self._rules.replicate_kv_heads()
            self._tp = TensorParallel(
                cfg.tp_size, cfg.batch_invariant_collectives,
                column_sites=frozenset(s for s in ("o", "down") if self._rules.column_parallel(s)),
                kv_head_replicas=self._kv_head_replicas)
        if self.mesh is not None:
            self._placement = param_placement(self.mesh, self._rules)
        self._eplb = cfg.eplb
        # --enable-eplb: each MoE layer's physical_to_logical map, int32[layers, P] (sharding/eplb.py)
        self.expert_placement = None if cfg.eplb is None else eplb.initial_placement(
            cfg.eplb.init_location, layers=model_config.num_hidden_layers,
            num_experts=model_config.num_experts, num_physical=cfg.eplb.num_physical)
        self._head_pad = 0 if self._tp is None else head_padding(
            model_config.vocab_size, cfg.tp_size, cfg.logprob_block_width)
        with jax.default_device(self._home):
            model = self._build_model(weights)
            # (layers, k) of a row's routed expert ids when the model routes tokens to experts: its
            # step program then has a third output, the ids of every row (docs/serving.md,
            # "Routed experts"). None for the dense families, whose program is unchanged.
            self.routing_shape = getattr(model, "routing_shape", None)
            self._graphdef, state = nnx.split(model)
            del model
        # The jitted programs take the parameters as one flat tuple: jit flattens a tuple of arrays
        # in C++, an nnx.State (hundreds of leaves) through Python callbacks -- host time each step.
        self._params, self._state_def = jax.tree.flatten(state)
        self._head_index = next(i for i, (path, _) in enumerate(jax.tree.flatten_with_path(state)[0])
                                if jax.tree_util.keystr(path).startswith("['lm_head']['weight']"))
        self._params = self._finish_params(tuple(self._params))
        self._host_params: tuple | None = None  # while the weights are released (release_weights)
        if self._eplb is not None:
            self._init_eplb(state)

        kv = cfg.kv
        self.page_size = kv.page_size
        self.max_context = kv.max_context
        self.max_pages_per_request = kv.max_pages_per_request
        self.num_pages = kv.num_pages
        # The pool, as the model's KV cache spec lays it out: per layer, one array per component
        # (K and V), not one [L, ...] array: each layer's scatter then updates its own donated
        # buffer in place. With one stacked array XLA rebuilt (concatenated) the whole pool every
        # step -- seen in the compiled HLO, and ~2x the pool's bytes of traffic per step.
        kv_spec = self.family.kv_cache_spec(model_config)
        if self._kv_head_replicas > 1:  # one slot per rank: each caches its own head's copy
            kv_spec = dataclasses.replace(kv_spec, layers=tuple(
                dataclasses.replace(layer, kv_heads=layer.kv_heads * self._kv_head_replicas)
                for layer in kv_spec.layers))
        self.kv_pool = KVPool(kv_spec, num_pages=kv.num_pages, page_size=kv.page_size,
                              dtype=self.dtype, sharding=self._kv_sharding(kv_spec))
        self.max_step_tokens = cfg.max_step_tokens

        forward, logits_rows = self._forward_impl, self._logits_rows_impl
        if self.mesh is not None:
            # One program per step over every rank: leaves see local arrays, never XLA's
            # partitioner. Specs are read off the placed arrays, so placement has one source.
            # check_vma=False: the leaves' loops (fixed-order GEMM, fori_loop carries) start from
            # unvarying zeros and would each need a pcast; the outputs declared replicated (hidden
            # states, logits) are so by construction: row sums and gathers end every rank's path.
            params = tuple(p.sharding.spec for p in self._params)
            pool = jax.tree.map(lambda a: a.sharding.spec, self.kv_pool.arrays)
            rep = PartitionSpec()
            routed = (rep,) if self.routing_shape else ()  # every rank routes every row
            forward = jax.shard_map(forward, mesh=self.mesh, in_specs=(params, pool) + (rep,) * 4,
                                    out_specs=(rep, pool) + routed, check_vma=False)
            logits_rows = jax.shard_map(logits_rows, mesh=self.mesh,
                                        in_specs=(params, rep, rep), out_specs=rep,
                                        check_vma=False)
        self._forward = jax.jit(forward, donate_argnums=(1,))
        self._fill_placeholders = jax.jit(fill_placeholders)
        self._logits_rows = jax.jit(logits_rows)
        self._vocab_parallel_heads = {}  # the Sampler's plans -> vocab_parallel_head's program

    def _kv_sharding(self, kv_spec):
        """The pool's placement: K/V pages split on kv_heads, like k_proj/v_proj's columns."""
        if self.mesh is None:
            return self._device
        if self._tp is None and not isinstance(kv_spec.layout, KVPages):
            # Expert parallelism alone: attention runs whole on every rank, so does its pool.
            return NamedSharding(self.mesh, PartitionSpec())
        if not isinstance(kv_spec.layout, KVPages):
            raise ValueError(f"mesh {dict(self.mesh.shape)}: the KV pool layout "
                             f"{kv_spec.layout!r} has no placement on it (only K/V pages do)")
        # [pages, page_size, kv_heads, head_dim]: split on kv_heads, like k_proj/v_proj's columns
        # -- or, under KV-head replication, one slot per rank (k/v_proj themselves are whole).
        axes = (None, None, "kv_heads", "head_dim")
        rules = rules_for(self._rules.layout)
        check_divisible("KV pool", (1, 1, *kv_spec.layout.page_shape), axes, rules, self.mesh)
        return NamedSharding(self.mesh, logical_to_spec(axes, rules))

    def _finish_params(self, params: tuple) -> tuple:
        """The built model's parameters as the step takes them: placed (`_replicate_unplaced`)
        and, under TP, the LM head padded with zero columns (`head_padding`)."""
        params = self._replicate_unplaced(params)
        if not self._head_pad:
            return params
        head = params[self._head_index]
        pad = jax.jit(lambda w: jnp.pad(w, ((0, 0), (0, self._head_pad))),
                      out_shardings=head.sharding)
        return params[: self._head_index] + (pad(head),) + params[self._head_index + 1:]

    def _replicate_unplaced(self, params: tuple) -> tuple:
        """Under TP, state with no ParamSpec (the RoPE tables) goes to every rank whole."""
        if self._device is not None:  # committed, so the step programs follow it to its device
            return tuple(jax.device_put(p, self._device) for p in params)
        if self.mesh is None:
            return params
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return tuple(p if isinstance(p.sharding, NamedSharding) and p.sharding.mesh == self.mesh
                     else jax.device_put(p, replicated) for p in params)

    def _build_model(self, weights):
        o = self.options
        tp = {} if self._tp is None else {"tensor_parallel": self._tp}
        if self._ep is not None:
            tp["expert_parallel"] = self._ep
        if self.expert_placement is not None:
            tp["expert_placement"] = self.expert_placement
        if o.mla_lora_scale is not None:  # only a body with MLA LoRA scales takes it
            tp["mla_lora_scale"] = o.mla_lora_scale
        return self.family.build(self.model_config,
                                 weight_source(weights, placement=self._placement),
                                 dtype=self.dtype, kernels=self.kernels,
                                 layer_boundary_norm=o.layer_boundary_norm,
                                 rope_frequency_device=o.rope_frequency_device,
                                 rope_ramp_device=o.rope_ramp_device, **tp)

    @property
    def width_invariant_gemms(self) -> bool:
        """Whether the planned GEMM leaves give an output element the same bits at any column
        count (their `width_invariant` trait): what column-parallel shards need for the TP1 bits."""
        return all(p.leaf.traits.get("width_invariant", False)
                   for p in (self.kernels.gemm, self.kernels.gemm_group))

    def parallelism(self) -> dict:
        """The mesh and how each projection is split (reported by /get_server_info)."""
        if self.mesh is None:
            return {"mesh": {"data": 1, "expert": 1, "tensor": 1}, "layout": "replicated"}
        if self._tp is None:  # expert parallelism alone: the experts split, the rest whole
            out = {"mesh": {str(k): int(v) for k, v in self.mesh.shape.items()},
                   "layout": self._rules.layout,
                   "projections": {"experts": "expert-parallel (whole experts per rank; "
                                              "tokens dispatched and combined by all-to-all)",
                                   "everything else": "replicated"}}
            if self._eplb is not None:
                out["eplb"] = {"physical_experts": self._eplb.num_physical,
                               "rebalances": self.eplb_rebalances}
            return out
        site = {True: "column-parallel on hidden (all-gather of the input, full-K GEMM)",
                False: "row-parallel (cross-rank sum: " + self._tp.row_sum_route.path + ")"}
        kv = ("column-parallel (KV heads split)" if self._kv_head_replicas == 1 else
              f"replicated; each rank computes its one KV head ({self._kv_head_replicas} ranks "
              "per head)")
        return {
            "mesh": {str(k): int(v) for k, v in self.mesh.shape.items()},
            "layout": self._rules.layout,
            "kv_head_replicas": self._kv_head_replicas,
            "gemm_width_invariant": self.width_invariant_gemms,
            "projections": {
                "embed_tokens": "vocab-parallel (row lookup + all-gather)",
                "q_proj": "column-parallel (heads)", "k_proj": kv, "v_proj": kv,
                "o_proj": site[self._tp.column_parallel("o")],
                "gate_proj": "column-parallel (mlp)", "up_proj": "column-parallel (mlp)",
                "down_proj": site[self._tp.column_parallel("down")],
                "lm_head": "vocab-parallel (local columns)" + (
                    f"; padded with {self._head_pad} zero columns so each rank holds whole "
                    "logprob blocks" if self._head_pad else ""),
            },
        }

    def param_specs(self) -> dict:
        """Every parameter's ParamSpec (path -> spec) of this runner's model."""
        return self.family.param_specs(self.model_config, dtype=self.dtype)

    def load_weights(self, weights) -> None:
        """Swap in new weights of the same shapes (a trainer's handoff after a step): a mapping
        of HF tensor name -> array, a checkpoint reader, or a weight source -- the same path the
        model was first loaded through, one tensor at a time.

        The KV pool is not touched: the caller flushes cached prefixes, which were computed with
        the old weights (the engine's update_weights_* do; docs/engine.md, "Weight updates").
        """
        self.swap_params(self.build_params(weights))

    def build_params(self, weights, *, only: frozenset[str] | None = None) -> tuple:
        """The parameter tuple `weights` give, built next to the serving one (nothing swapped).

        The model is rebuilt from the runner's config with the frozen kernel plans, so it has the
        same structure; each tensor is checked against its spec (name, shape) as it is read.
        only: the tensors `weights` holds when it is a partial update (a reader naming only
        them); every other parameter keeps its current array (`OverlaySource`).
        """
        if only is not None:
            model = self._model(self._live_params())
            named, specs = model.named_parameters(), self.param_specs()
            if self._head_pad:  # the model's own columns (_finish_params pads the rebuilt head)
                head = named["lm_head.weight"]
                named["lm_head.weight"] = jax.jit(
                    lambda w: w[:, : self.model_config.vocab_size],
                    out_shardings=head.sharding)(head)
            if self.expert_placement is not None:
                self._logical_experts(named)
            weights = OverlaySource(weights, {specs[p]: named[p] for p in specs})
        with jax.default_device(self._home):
            _, state = nnx.split(self._build_model(weights))
        return self._finish_params(tuple(jax.tree.leaves(state)))

    def swap_params(self, params: tuple) -> None:
        """Serve `params` from the next step on. Same shapes and dtypes as the current tuple, so
        the compiled step programs are reused (a difference here would be a runner bug)."""
        old = self._host_params if self._params is None else self._params
        for i, (new, cur) in enumerate(zip(params, old, strict=True)):
            if new.shape != cur.shape or new.dtype != cur.dtype:
                raise ValueError(f"parameter {i}: {new.shape} {new.dtype} would replace "
                                 f"{cur.shape} {cur.dtype}")
        self._params, self._host_params = tuple(params), None

    def _live_params(self) -> tuple:
        if self._params is None:
            raise RuntimeError("the weights are released; resume them first")
        return self._params

    # -- memory release -----------------------------------------------------------------------------
    @property
    def weights_released(self) -> bool:
        return self._params is None

    def release_weights(self) -> None:
        """Copy the parameters to the host, then free their device buffers now. `resume_weights`
        puts the same bytes back on the same placement (a weight update also ends the release)."""
        if self._params is None:
            return
        # An uncommitted array goes back uncommitted: committed-ness is part of the jit cache key.
        self._placements = tuple(p.sharding if p.committed else None for p in self._params)
        self._host_params = tuple(np.asarray(p) for p in self._params)
        for p in self._params:
            p.delete()
        self._params = None

    def resume_weights(self) -> None:
        if self._params is None:
            self._params = tuple(jax.device_put(h, s)
                                 for h, s in zip(self._host_params, self._placements))
            self._host_params = None

    def _model(self, params):
        return nnx.merge(self._graphdef, jax.tree.unflatten(self._state_def, params))

    # -- jitted bodies ----------------------------------------------------------------------------
    def _forward_impl(self, params, kv, input_ids, positions, token_req, block_tables):
        model = self._model(params)
        if self.routing_shape:
            return model.forward_routed(input_ids, positions, token_req, block_tables, kv)
        return model(input_ids, positions, token_req, block_tables, kv)

    def _logits_rows_impl(self, params, hidden, rows):
        return self._model(params).compute_logits(hidden[rows])

    # -- the step ---------------------------------------------------------------------------------
    def forward(self, batch: StepBatch) -> jax.Array:
        """Run one step; returns final-norm hidden states [S, H] for ``batch.hidden_rows``."""
        return jnp.take(self.forward_padded(batch), jnp.asarray(batch.hidden_rows, jnp.int32),
                        axis=0)

    def forward_padded(self, batch: StepBatch, previous_tokens=None) -> jax.Array:
        """Run one step; returns the final-norm hidden states of every row of the step's token
        bucket [T_pad, H] (rows past batch.num_tokens are padding). The engine's path: pair it
        with `logits_at`, so no program is compiled per number of returned rows.
        previous_tokens: the sampled ids of the step in flight, which the batch's placeholder
        rows read on the device (`batch.fill_placeholders`); None when it has none."""
        return self.forward_routed(batch, previous_tokens)[0]

    def forward_routed(self, batch: StepBatch,
                       previous_tokens=None) -> tuple[jax.Array, jax.Array | None]:
        """`forward_padded`'s hidden states and, for a model that routes tokens to experts, the
        expert ids int32[T_pad, layers, k] of every row (None otherwise). The same program: the
        ids stay on the device unless the caller reads them."""
        t = batch.num_tokens
        if t == 0:
            raise ValueError("empty step batch")
        t_pad = next_pow2(t, MIN_TOKEN_BUCKET)
        p = batch.block_tables.shape[1]
        p_pad = min(next_pow2(max(p, 1)), next_pow2(self.max_pages_per_request))
        p_pad = max(p_pad, p)
        # Requests never outnumber tokens, so the block table shares the token bucket: row t_pad-1
        # is then always a padding row of null pages, and padding tokens point at it.
        r = len(batch.block_tables)
        input_ids = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        token_req = np.full(t_pad, t_pad - 1, np.int32)
        block_tables = np.full((t_pad, p_pad), NULL_PAGE, np.int32)
        input_ids[:t] = batch.input_ids
        positions[:t] = batch.positions
        token_req[:t] = batch.token_req
        block_tables[:r, :p] = batch.block_tables
        if self._eplb is not None and self._eplb.rebalance_interval and \
                self.eplb_steps >= self._eplb.rebalance_interval:
            self.rebalance_experts()
        if previous_tokens is not None:
            # A separate small program, so the step program (and its bits) is the one without
            # overlap; the ids stay on the device, and nothing here waits for the step in flight.
            input_ids = self._fill_placeholders(input_ids, previous_tokens)
        pool = self.kv_pool
        hidden, pool.arrays, *routed = self._forward(self._params, pool.arrays, input_ids,
                                                     positions, token_req, block_tables)
        if self._eplb is not None:
            self._expert_load = self._count_load(self._expert_load, routed[0], np.int32(t))
            self.eplb_steps += 1
        return hidden, (routed[0] if routed else None)

    # -- EPLB (sharding/eplb.py) --------------------------------------------------------------------
    def _init_eplb(self, state) -> None:
        """Find each MoE layer's map and expert weights in the flat parameter tuple."""
        self._eplb_slots = {}  # layer -> (index of its map, indices of its 3 expert weights)
        for i, (path, _) in enumerate(jax.tree.flatten_with_path(state)[0]):
            m = _MOE_LEAF.match(jax.tree_util.keystr(path))
            if m:
                layer = self._eplb_slots.setdefault(int(m.group(1)), [None, []])
                if m.group(2) == "physical_to_logical":
                    layer[0] = i
                else:
                    layer[1].append(i)
        self._count_load = jax.jit(eplb.count_load)
        self._reset_load()
        self.eplb_rebalances = 0

    def _reset_load(self) -> None:
        self._expert_load = jnp.zeros((self.model_config.num_hidden_layers,
                                       self.model_config.num_experts), jnp.int32)
        self.eplb_steps = 0

    def _logical_experts(self, named: dict) -> None:
        """Each MoE layer's held experts in `named` (physical slots, [P, ...]) -> the logical
        [E, ...] weights its specs declare: expert e from its first slot (every replica holds the
        same bytes). What a partial update keeps must be logical: the rebuilt model gathers its
        slots from it again, by the current placement (`SparseMoE.place_experts`)."""
        logical = np.arange(self.model_config.num_experts, dtype=np.int32)
        for layer in self._eplb_slots:
            src = eplb.source_slots(self.expert_placement[layer], logical)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                path = f"layers.{layer}.mlp.experts.{proj}"
                named[path] = eplb.gather_slots(named[path], src)

    def expert_load(self) -> np.ndarray:
        """Routed (row, slot) pairs per logical expert, int[layers, E], since the last rebalance."""
        return np.asarray(self._expert_load)

    def rebalance_experts(self, placement=None) -> dict:
        """Move each MoE layer to `placement` (int32[layers, P]; default: `balanced_placement` of
        the measured load), between steps. New arrays of the old shapes and placements: the slots'
        weights re-gathered on the device, the maps swapped in; no step program is compiled."""
        if self._eplb is None:
            raise ValueError("rebalance_experts: this launch has no --enable-eplb")
        load = self.expert_load()
        if placement is None:
            placement = self.expert_placement.copy()
            for layer in self._eplb_slots:
                placement[layer] = eplb.balanced_placement(load[layer], self._eplb.num_physical,
                                                           self._ep.size)
        params = list(self._live_params())
        for layer, (map_index, weights) in self._eplb_slots.items():
            new = eplb.check_placement(placement[layer], self.model_config.num_experts,
                                       self._eplb.num_physical, f"layer {layer}")
            src = eplb.source_slots(self.expert_placement[layer], new)
            for i in weights:
                params[i] = eplb.gather_slots(params[i], src)
            params[map_index] = jax.device_put(new, params[map_index].sharding)
        self.swap_params(tuple(params))
        self.expert_placement = np.asarray(placement, np.int32)
        self.eplb_rebalances += 1
        self._reset_load()
        return {"load": load.tolist(), "physical_to_logical": self.expert_placement.tolist()}

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[n, H] -> [n, V] float32, computed in a padded bucket (rows are independent)."""
        n = hidden.shape[0]
        return self.logits_at(hidden, np.arange(n))[:n]

    def logits_at(self, hidden_padded: jax.Array, rows) -> jax.Array:
        """Logits [n_pad, V] float32 of ``hidden_padded[rows]`` (n = len(rows) real rows first, then
        padding rows up to the power-of-two bucket n_pad >= MIN_LOGIT_BUCKET). One jitted program
        per (T bucket, n bucket): the sampler takes these padded logits with n as its row count."""
        rows = np.asarray(rows, np.int32)
        idx = np.zeros(next_pow2(len(rows), MIN_LOGIT_BUCKET), np.int32)
        idx[: len(rows)] = rows
        return self._logits_rows(self._params, hidden_padded, idx)

    # -- the vocab-parallel head (sharding/vocab_parallel.py) ----------------------------------------
    def scores_without_gather(self, sampler) -> bool:
        """Whether `score_rows` can serve `sampler`'s greedy tokens, logprobs and top-k here: TP > 1
        and a blockwise logprob order whose blocks each sit on one rank (else the step gathers the
        logits and the Sampler scores them: the same bits, [rows, V] f32 moved per step)."""
        return self._vocab_parallel_head(sampler) is not None

    def _vocab_parallel_head(self, sampler):
        if self._tp is None:
            return None
        key = tuple(sorted(sampler.describe().items()))
        if key not in self._vocab_parallel_heads:
            def local_logits(params, hidden):  # the LM head without tp: this rank's columns
                model = self._model(params)
                return model.lm_head(model.kernels, hidden, out_dtype=model.dtype)

            try:
                head = make_vocab_parallel_head(
                    self.mesh, tuple(p.sharding.spec for p in self._params), local_logits,
                    order=sampler.logprob_order, block_sumexp_plan=sampler.block_sumexp_plan,
                    argmax_plan=sampler.argmax_plan, vocab_size=sampler.vocab_size,
                    head_columns=sampler.vocab_size + self._head_pad)
            except ValueError as e:
                logger.info("the step gathers the logits: %s", e)
                head = None
            self._vocab_parallel_heads[key] = head
        return self._vocab_parallel_heads[key]

    def score_rows(self, hidden_padded: jax.Array, rows, sampler, *, target_ids=None,
                   k: int = 0) -> tuple[np.ndarray, np.ndarray, tuple | None]:
        """For ``hidden_padded[rows]``: (greedy ids int32[n], logprobs float32[n] of target_ids --
        of the greedy ids when None --, (top-k values, ids) or None), with the bits `sampler`
        gives on `logits_at` (canonical argmax, `token_logprobs`, `top_logprobs`), while every
        rank keeps its own logits columns. Only where `scores_without_gather(sampler)`."""
        head = self._vocab_parallel_head(sampler)
        if head is None:
            raise ValueError("score_rows: no vocab-parallel head here (tp_size=1, or a logprob "
                             "order whose blocks straddle ranks); use logits_at and the Sampler")
        n = len(rows)
        bucket = next_pow2(n, MIN_LOGIT_BUCKET)  # logits_at's buckets
        idx, ids = np.zeros(bucket, np.int32), np.zeros(bucket, np.int32)
        idx[:n] = rows
        if target_ids is not None:
            ids[:n] = target_ids
        greedy, logprobs, values, top_ids = head(self._params, hidden_padded, idx, ids,
                                                 greedy_targets=target_ids is None, k=k)
        tops = (np.asarray(values)[:n], np.asarray(top_ids)[:n]) if k else None
        return np.asarray(greedy)[:n].astype(np.int32), np.asarray(logprobs)[:n], tops

    # -- page images (prefix-cache copy-on-write, retraction) --------------------------------------
    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.kv_pool.copy(src, dst)

    def read_pages(self, pages: list[int]) -> np.ndarray:
        """The exact bytes of those pages (KVPool.read: for K/V pages [2, L, n, page_size, Hkv, D])."""
        return self.kv_pool.read(pages)

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        self.kv_pool.write(pages, data)

    # -- inspection (interop/bisect.py) -------------------------------------------------------------
    def forward_sequence(self, ids, *, instrument=None):
        """(final-norm hidden [T, H], extra) of one sequence at positions 0..T-1, on a private
        zeroed KV pool (never the engine's).

        instrument=None: the real step program; extra is None. Else `instrument(model)` is called
        inside a fresh jit with the rebuilt model before its forward -- it may wrap the model's
        kernel plans, and read `model.named_parameters()` -- and returns `finish`; `finish()` runs
        after the forward and its (pytree of arrays) value is returned as extra.
        """
        ids = np.asarray(ids, np.int32)
        t = len(ids)
        pages = -(-t // self.page_size)
        inputs = (ids, np.arange(t, dtype=np.int32), np.zeros(t, np.int32),
                  np.arange(1, pages + 1, dtype=np.int32)[None])  # ids, positions, req, table
        kv = self.kv_pool.allocate(pages + 1)
        if instrument is None:
            return self._forward(self._params, kv, *inputs)[0], None

        if self._tp is not None:
            raise NotImplementedError(f"forward_sequence(instrument=...) at tp_size={self._tp.size}:"
                                      " instrumented runs are single-device only so far")

        def run(params, kv, *inputs):
            model = self._model(params)
            finish = instrument(model)
            hidden, _ = model(*inputs, kv)
            return hidden, finish()

        return jax.jit(run)(self._params, kv, *inputs)

    # -- startup ----------------------------------------------------------------------------------
    def token_buckets(self) -> list[int]:
        top = next_pow2(self.max_step_tokens, MIN_TOKEN_BUCKET)
        return [1 << i for i in range(MIN_TOKEN_BUCKET.bit_length() - 1, top.bit_length())]

    def page_buckets(self) -> list[int]:
        top = next_pow2(self.max_pages_per_request)
        return [1 << i for i in range(top.bit_length())]

    def warmup(self) -> float:
        """Compile every (tokens, pages) bucket; returns the seconds it took."""
        start = time.perf_counter()
        combos = list(itertools.product(self.token_buckets(), self.page_buckets()))
        for t, p in tqdm(combos, desc="compiling step buckets", unit="bucket"):
            # A real call (not .lower().compile()) so the jit dispatch cache is filled; every row is
            # padding, so no K/V is written.
            _, self.kv_pool.arrays, *_ = self._forward(
                self._params, self.kv_pool.arrays, np.zeros(t, np.int32), np.zeros(t, np.int32),
                np.zeros(t, np.int32), np.full((t, p), NULL_PAGE, np.int32))
        seconds = time.perf_counter() - start
        logger.info("compiled %d step buckets in %.1f s", len(combos), seconds)
        return seconds

    # -- the scheduler's page commands --------------------------------------------------------------
    def execute_kv_transfers(self, transfers) -> None:
        """Run a step's `KVTransfer`s (jengine/engine/batch.py) in the order given, before its
        forward: a page a retraction saves may be the very page a later restore writes."""
        from jengine.engine.batch import PageCopy, PageRestore, PageSave

        for t in transfers:
            if isinstance(t, PageCopy):
                self.copy_pages(list(t.src), list(t.dst))
            elif isinstance(t, PageSave):
                t.image.kv = self.read_pages(list(t.pages))  # an exact byte copy, to the host
            elif isinstance(t, PageRestore):
                if not t.image.saved:
                    raise RuntimeError(f"restore into pages {list(t.pages)}: its image was never saved")
                self.write_pages(list(t.pages), t.image.kv)
            else:
                raise TypeError(f"kv transfer {t!r} is not a PageCopy, PageSave or PageRestore")
