"""Where the runner's arrays live: the mesh, each parameter's and the KV pool's placement, the LM
head's padding, and the `parallelism()` report of it all.

`RunnerPlacement` is built from the runner's config, its device group and the model config, before
the model: the model is built through it (its weight placement, `TensorParallel`,
`ExpertParallel`), and the runner's finished parameters and KV pool are placed by it. The generic
pieces -- the mesh, the logical-axis rules, the collectives -- stay in sharding/; this module only
decides, for one runner, which of them apply.

Three shapes of launch:
  * tp_size == ep_size == 1 without `devices`: nothing is built; arrays stay where jax puts them.
  * tp_size == ep_size == 1 with a data-parallel replica's `devices`: everything is committed to
    that replica's one device, so every jitted program runs there.
  * tp_size > 1 or ep_size > 1: a mesh; every parameter is placed from its ParamSpec's logical
    axes through the layout's rules (sharding/rules.py), state with no ParamSpec goes whole to
    every rank, and the KV pool is split on kv_heads like k_proj/v_proj's columns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jengine.launch import RunnerConfig
from jengine.models.kv_cache import KVPages
from sharding.expert_parallel import ExpertParallel
from sharding.mesh import make_mesh
from sharding.rules import check_divisible, layout_for, logical_to_spec, param_placement, rules_for
from sharding.tensor_parallel import TensorParallel, head_padding, kv_head_replicas


class RunnerPlacement:
    def __init__(self, model_config, cfg: RunnerConfig, devices: tuple | None = None):
        self.mesh = self.tp = self.ep = self.device = self.home = None
        # spec -> NamedSharding, what the weight source places each tensor by as it is read
        self.param_placement = None
        self.kv_head_replicas = 1
        if cfg.tp_size == 1 and cfg.ep_size == 1 and devices is not None:
            # A replica's model is built on its own device (never staged on the default one),
            # then committed there.
            self.home = devices[0]
            self.device = SingleDeviceSharding(self.home)
        if cfg.tp_size > 1 or cfg.ep_size > 1:
            self.mesh = make_mesh(tp=cfg.tp_size, ep=cfg.ep_size, devices=devices)
            self.rules = rules_for(layout_for(cfg.tp_size, cfg.tp_batch_invariant))
        if cfg.ep_size > 1:
            self.ep = ExpertParallel(cfg.ep_size)
        if cfg.tp_size > 1:
            self.kv_head_replicas = kv_head_replicas(model_config.num_attention_heads,
                                                     model_config.num_key_value_heads, cfg.tp_size)
            if self.kv_head_replicas > 1:
                self.rules = self.rules.replicate_kv_heads()
            self.tp = TensorParallel(
                cfg.tp_size, cfg.batch_invariant_collectives,
                column_sites=frozenset(s for s in ("o", "down") if self.rules.column_parallel(s)),
                kv_head_replicas=self.kv_head_replicas)
        if self.mesh is not None:
            self.param_placement = param_placement(self.mesh, self.rules)
        self.head_pad = 0 if self.tp is None else head_padding(
            model_config.vocab_size, cfg.tp_size, cfg.logprob_block_width)
        self.vocab_size = model_config.vocab_size
        # One program per head placement (in practice one), so a weight update compiles nothing.
        self._pad_programs: dict = {}
        self._unpad_programs: dict = {}

    def model_options(self) -> dict:
        """The parallel plans the model holds, like its kernel plans (family.build's keywords)."""
        out = {}
        if self.tp is not None:
            out["tensor_parallel"] = self.tp
        if self.ep is not None:
            out["expert_parallel"] = self.ep
        return out

    # -- parameters --------------------------------------------------------------------------------
    def finish_params(self, params: tuple, head_index: int) -> tuple:
        """The built model's parameters as the step takes them: placed (`_replicate_unplaced`)
        and, under TP, the LM head (params[head_index]) padded with zero columns
        (`head_padding`)."""
        params = self._replicate_unplaced(params)
        if not self.head_pad:
            return params
        head = params[head_index]
        if head.sharding not in self._pad_programs:
            self._pad_programs[head.sharding] = jax.jit(
                lambda w: jnp.pad(w, ((0, 0), (0, self.head_pad))), out_shardings=head.sharding)
        padded = self._pad_programs[head.sharding](head)
        return params[:head_index] + (padded,) + params[head_index + 1:]

    def unpad_head(self, head: jax.Array) -> jax.Array:
        """The LM head's own columns (the model's), without the padding `finish_params` adds."""
        if not self.head_pad:
            return head
        if head.sharding not in self._unpad_programs:
            self._unpad_programs[head.sharding] = jax.jit(
                lambda w: w[:, : self.vocab_size], out_shardings=head.sharding)
        return self._unpad_programs[head.sharding](head)

    def _replicate_unplaced(self, params: tuple) -> tuple:
        """Under TP, state with no ParamSpec (the RoPE tables) goes to every rank whole."""
        if self.device is not None:  # committed, so the step programs follow it to its device
            return tuple(jax.device_put(p, self.device) for p in params)
        if self.mesh is None:
            return params
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return tuple(p if isinstance(p.sharding, NamedSharding) and p.sharding.mesh == self.mesh
                     else jax.device_put(p, replicated) for p in params)

    # -- the step ----------------------------------------------------------------------------------
    def shard_step(self, forward, logits_rows, params: tuple, head_index: int, pool, *,
                   routed: bool):
        """The runner's step bodies (forward(params, pool, 4 step inputs) -> (hidden, pool[,
        routed ids]); logits_rows(params[head_index], hidden, rows) -> logits) as one program over
        every rank each; unchanged without a mesh. The specs are read off the placed arrays, so
        placement has one source."""
        if self.mesh is None:
            return forward, logits_rows
        # Leaves see local arrays, never XLA's partitioner. check_vma=False: the leaves' loops
        # (fixed-order GEMM, fori_loop carries) start from unvarying zeros and would each need a
        # pcast; the outputs declared replicated (hidden states, logits) are so by construction:
        # row sums and gathers end every rank's path.
        head = params[head_index].sharding.spec
        params = tuple(p.sharding.spec for p in params)
        pool = jax.tree.map(lambda a: a.sharding.spec, pool)
        rep = PartitionSpec()
        out_routed = (rep,) if routed else ()  # every rank routes every row
        forward = jax.shard_map(forward, mesh=self.mesh, in_specs=(params, pool) + (rep,) * 4,
                                out_specs=(rep, pool) + out_routed, check_vma=False)
        logits_rows = jax.shard_map(logits_rows, mesh=self.mesh, in_specs=(head, rep, rep),
                                    out_specs=rep, check_vma=False)
        return forward, logits_rows

    # -- the KV pool -------------------------------------------------------------------------------
    def kv_cache_spec(self, spec):
        """The model's KV cache spec as the pool lays it out here: under KV-head replication one
        slot per rank, each caching its own head's copy."""
        if self.kv_head_replicas == 1:
            return spec
        return dataclasses.replace(spec, layers=tuple(
            dataclasses.replace(layer, kv_heads=layer.kv_heads * self.kv_head_replicas)
            for layer in spec.layers))

    def kv_sharding(self, kv_spec):
        """The pool's placement: K/V pages split on kv_heads, like k_proj/v_proj's columns."""
        if self.mesh is None:
            return self.device
        if self.tp is None and not isinstance(kv_spec.layout, KVPages):
            # Expert parallelism alone: attention runs whole on every rank, so does its pool.
            return NamedSharding(self.mesh, PartitionSpec())
        if not isinstance(kv_spec.layout, KVPages):
            raise ValueError(f"mesh {dict(self.mesh.shape)}: the KV pool layout "
                             f"{kv_spec.layout!r} has no placement on it (only K/V pages do)")
        # [pages, page_size, kv_heads, head_dim]: split on kv_heads, like k_proj/v_proj's columns
        # -- or, under KV-head replication, one slot per rank (k/v_proj themselves are whole).
        axes = (None, None, "kv_heads", "head_dim")
        rules = rules_for(self.rules.layout)
        check_divisible("KV pool", (1, 1, *kv_spec.layout.page_shape), axes, rules, self.mesh)
        return NamedSharding(self.mesh, logical_to_spec(axes, rules))

    # -- the report --------------------------------------------------------------------------------
    def report(self, *, gemm_width_invariant: bool, eplb: dict | None = None) -> dict:
        """The mesh and how each projection is split (`ModelRunner.parallelism`, reported by
        /get_server_info). gemm_width_invariant: the planned GEMM leaves' trait; eplb: the EPLB
        state's report, shown under expert parallelism alone."""
        if self.mesh is None:
            return {"mesh": {"data": 1, "expert": 1, "tensor": 1}, "layout": "replicated"}
        mesh = {str(k): int(v) for k, v in self.mesh.shape.items()}
        if self.tp is None:  # expert parallelism alone: the experts split, the rest whole
            out = {"mesh": mesh, "layout": self.rules.layout,
                   "projections": {"experts": "expert-parallel (whole experts per rank; "
                                              "tokens dispatched and combined by all-to-all)",
                                   "everything else": "replicated"}}
            if eplb is not None:
                out["eplb"] = eplb
            return out
        site = {True: "column-parallel on hidden (all-gather of the input, full-K GEMM)",
                False: "row-parallel (cross-rank sum: " + self.tp.row_sum_route.path + ")"}
        kv = ("column-parallel (KV heads split)" if self.kv_head_replicas == 1 else
              f"replicated; each rank computes its one KV head ({self.kv_head_replicas} ranks "
              "per head)")
        return {
            "mesh": mesh,
            "layout": self.rules.layout,
            "kv_head_replicas": self.kv_head_replicas,
            "gemm_width_invariant": gemm_width_invariant,
            "projections": {
                "embed_tokens": "vocab-parallel (row lookup + all-gather)",
                "q_proj": "column-parallel (heads)", "k_proj": kv, "v_proj": kv,
                "o_proj": site[self.tp.column_parallel("o")],
                "gate_proj": "column-parallel (mlp)", "up_proj": "column-parallel (mlp)",
                "down_proj": site[self.tp.column_parallel("down")],
                "lm_head": "vocab-parallel (local columns)" + (
                    f"; padded with {self.head_pad} zero columns so each rank holds whole "
                    "logprob blocks" if self.head_pad else ""),
            },
        }
