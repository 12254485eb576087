"""The model runner: weights, the paged KV pool, and the jitted step over fixed shape buckets.

It knows models only through the registry (jengine/models/registry.py): the family builds the
model from a weight source, plans its kernels, and declares the KV cache spec the pool is
allocated from (jengine/models/kv_cache.py).

The scheduler hands over a `StepBatch` of exact sizes; the runner pads it to a (tokens, pages)
bucket so the number of compiled programs stays small, runs the jitted forward with the KV pool
donated (updated in place), and returns the hidden states of the rows the caller asked for.
Padding rows point at the null page, their K/V writes are dropped, and real rows never read it, so
padding cannot change a real row's bits.

Where the parameters and the pool live -- the mesh, their shardings, a data-parallel replica's
one device, the LM head's padding -- is decided by `RunnerPlacement` (jengine/engine/placement.py).
On a mesh the runner runs the whole step -- and the LM head -- under one `jax.shard_map`: the model
computes on its local shards and talks to other ranks only at the call sites of
sharding/tensor_parallel.py. Without one the step is the single-device program.

Under --enable-eplb the runner holds an `ExpertPlacementState` (jengine/engine/expert_placement.py):
each step's routed ids are counted into it, and a rebalance's parameters are swapped in between
steps like a weight update.
"""

from __future__ import annotations

import itertools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jengine.engine.batch import StepBatch, fill_placeholders
from jengine.engine.expert_placement import ExpertPlacementState
from jengine.engine.kv_pool import KVPool
from jengine.engine.placement import RunnerPlacement
from jengine.engine.served_params import ServedParams
from jengine.engine.vocab_scoring import VocabParallelScoring
from jengine.launch import RunnerConfig
from jengine.models.kv_cache import NULL_PAGE
from jengine.models.layers.param import OverlaySource, weight_source
from jengine.models.registry import get_family
from pallas_kernels import counter_chain
from pallas_kernels._triton_launch import missing_gpu_leaves
from pallas_kernels.fixed_order import next_pow2

logger = logging.getLogger(__name__)

MIN_TOKEN_BUCKET = 16
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
        if (warning := missing_gpu_leaves(cfg.model.hardware)) is not None:
            logger.warning(warning)
        self.placement = RunnerPlacement(model_config, cfg, devices)
        # --enable-eplb: the placement of every MoE layer's experts and the load measured since
        # the last rebalance; None without it
        self.eplb = None if cfg.eplb is None else ExpertPlacementState(cfg.eplb, model_config,
                                                                       cfg.ep_size)
        with jax.default_device(self.placement.home):
            model = self._build_model(weights)
            # (layers, k) of a row's routed expert ids when the model routes tokens to experts: its
            # step program then has a third output, the ids of every row (docs/serving.md,
            # "Routed experts"). None for the dense families, whose program is unchanged.
            self.routing_shape = getattr(model, "routing_shape", None)
            self._graphdef, state = nnx.split(model)
            del model
        # The jitted programs take the parameters as one flat tuple: jit flattens a tuple of arrays
        # in C++, an nnx.State (hundreds of leaves) through Python callbacks -- host time each step.
        leaves, self._state_def = jax.tree.flatten(state)
        paths = [jax.tree_util.keystr(path) for path, _ in jax.tree.flatten_with_path(state)[0]]
        self._head_index = next(i for i, path in enumerate(paths)
                                if path.startswith("['lm_head']['weight']"))
        self.params = ServedParams(self.placement.finish_params(tuple(leaves), self._head_index))
        if self.eplb is not None:
            self.eplb.locate(paths)

        kv = cfg.kv
        self.page_size = kv.page_size
        self.max_context = kv.max_context
        self.max_pages_per_request = kv.max_pages_per_request
        self.num_pages = kv.num_pages
        # The pool, as the model's KV cache spec lays it out: per layer, one array per component
        # (K and V), not one [L, ...] array: each layer's scatter then updates its own donated
        # buffer in place. With one stacked array XLA rebuilt (concatenated) the whole pool every
        # step -- seen in the compiled HLO, and ~2x the pool's bytes of traffic per step.
        kv_spec = self.placement.kv_cache_spec(self.family.kv_cache_spec(model_config))
        self.kv_pool = KVPool(kv_spec, num_pages=kv.num_pages, page_size=kv.page_size,
                              dtype=self.dtype, sharding=self.placement.kv_sharding(kv_spec))
        self.max_step_tokens = cfg.max_step_tokens

        forward, logits_rows = self.placement.shard_step(
            self._forward_impl, self._logits_rows_impl, self._params, self._head_index,
            self.kv_pool.arrays, routed=bool(self.routing_shape))
        self._forward = jax.jit(forward, donate_argnums=(1,))
        self._fill_placeholders = jax.jit(fill_placeholders)
        self._logits_rows = jax.jit(logits_rows)
        self._scoring = VocabParallelScoring(self.placement, self._model, MIN_LOGIT_BUCKET)

    @property
    def _params(self) -> tuple | None:
        """The served parameter tuple every step program takes (None while released)."""
        return self.params.arrays

    def _build_model(self, weights):
        o = self.options
        tp = self.placement.model_options()
        if self.eplb is not None:
            tp["expert_placement"] = self.eplb.placement
        if o.mla_lora_scale is not None:  # only a body with MLA LoRA scales takes it
            tp["mla_lora_scale"] = o.mla_lora_scale
        return self.family.build(self.model_config,
                                 weight_source(weights, placement=self.placement.param_placement),
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
        return self.placement.report(gemm_width_invariant=self.width_invariant_gemms,
                                     eplb=None if self.eplb is None else self.eplb.report())

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
            model = self._model(self.params.live())
            named, specs = model.named_parameters(), self.param_specs()
            # the model's own columns (finish_params pads the rebuilt head)
            named["lm_head.weight"] = self.placement.unpad_head(named["lm_head.weight"])
            if self.eplb is not None:
                self.eplb.logical_experts(named)
            weights = OverlaySource(weights, {specs[p]: named[p] for p in specs})
        with jax.default_device(self.placement.home):
            _, state = nnx.split(self._build_model(weights))
        return self.placement.finish_params(tuple(jax.tree.leaves(state)), self._head_index)

    # -- swaps and memory release (jengine/engine/served_params.py) -----------------------------------
    def swap_params(self, params: tuple) -> None:
        """Serve `params` (same shapes and dtypes) from the next step on (`ServedParams.swap`)."""
        self.params.swap(params)

    @property
    def weights_released(self) -> bool:
        return self.params.released

    def release_weights(self) -> None:
        """Copy the parameters to the host, then free their device buffers now. `resume_weights`
        puts the same bytes back on the same placement (a weight update also ends the release)."""
        self.params.release()

    def resume_weights(self) -> None:
        self.params.resume()

    def _model(self, params):
        return nnx.merge(self._graphdef, jax.tree.unflatten(self._state_def, params))

    # -- jitted bodies -----------------------------------------------------------------------------
    def _forward_impl(self, params, kv, input_ids, positions, token_req, block_tables):
        model = self._model(params)
        # One counter buffer for the step's counting launches (the Triton GEMMs' fused reduce,
        # the split attention's merge) instead of a memset before each: _triton_launch.Counters.
        with counter_chain():
            if self.routing_shape:
                return model.forward_routed(input_ids, positions, token_req, block_tables, kv)
            return model(input_ids, positions, token_req, block_tables, kv)

    def _logits_rows_impl(self, head, hidden, rows):
        # The program takes the LM head alone: the runtime holds and checks every buffer a call
        # passes, and the whole tuple (~290 arrays for an 8B model) cost each step ~0.5 ms of host
        # time for a program that reads one of them. The rest of the model is rebuilt from
        # abstract placeholders, so compute_logits stays the one definition of the logits, and one
        # that read another parameter would fail to trace (a placeholder holds no value).
        params = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in self._params]
        params[self._head_index] = head
        return self._model(tuple(params)).compute_logits(hidden[rows])

    # -- the step ----------------------------------------------------------------------------------
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
        input_ids, positions, token_req, block_tables = self.padded_inputs(batch)
        if self.eplb is not None and self.eplb.rebalance_due():
            self.rebalance_experts()
        if previous_tokens is not None:
            # A separate small program, so the step program (and its bits) is the one without
            # overlap; the ids stay on the device, and nothing here waits for the step in flight.
            input_ids = self._fill_placeholders(input_ids, previous_tokens)
        pool = self.kv_pool
        hidden, pool.arrays, *routed = self._forward(self._params, pool.arrays, input_ids,
                                                     positions, token_req, block_tables)
        if self.eplb is not None:
            self.eplb.count(routed[0], batch.num_tokens)
        return hidden, (routed[0] if routed else None)

    def padded_inputs(self, batch: StepBatch) -> tuple[np.ndarray, ...]:
        """(input_ids, positions, token_req, block_tables) of the step program: the batch padded
        to its token bucket and page bucket, so one program serves every batch of a bucket."""
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
        return input_ids, positions, token_req, block_tables

    # -- EPLB (jengine/engine/expert_placement.py) -------------------------------------------------
    def rebalance_experts(self, placement=None) -> dict:
        """Move each MoE layer to `placement` (`ExpertPlacementState.rebalance`), between steps:
        the new arrays have the old shapes and placements, so no step program is compiled."""
        if self.eplb is None:
            raise ValueError("rebalance_experts: this launch has no --enable-eplb")
        params, report = self.eplb.rebalance(self.params.live(), placement)
        self.swap_params(params)
        return report

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
        return self._logits_rows(self._params[self._head_index], hidden_padded, idx)

    # -- the vocab-parallel head (jengine/engine/vocab_scoring.py) -------------------------------------
    def scores_without_gather(self, sampler) -> bool:
        """Whether `score_rows` can serve `sampler`'s greedy tokens, logprobs and top-k here: TP > 1
        and a blockwise logprob order whose blocks each sit on one rank (else the step gathers the
        logits and the Sampler scores them: the same bits, [rows, V] f32 moved per step)."""
        return self._scoring.head(sampler, self._params) is not None

    def score_rows(self, hidden_padded: jax.Array, rows, sampler, *, target_ids=None,
                   k: int = 0) -> tuple[np.ndarray, np.ndarray, tuple | None]:
        """For ``hidden_padded[rows]``: (greedy ids int32[n], logprobs float32[n] of target_ids --
        of the greedy ids when None --, (top-k values, ids) or None), with the bits `sampler`
        gives on `logits_at` (canonical argmax, `token_logprobs`, `top_logprobs`), while every
        rank keeps its own logits columns. Only where `scores_without_gather(sampler)`."""
        return self._scoring.score_rows(self._params, hidden_padded, rows, sampler,
                                        target_ids=target_ids, k=k)

    # -- page images (prefix-cache copy-on-write, retraction) --------------------------------------
    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.kv_pool.copy(src, dst)

    def read_pages(self, pages: list[int]) -> np.ndarray:
        """The exact bytes of those pages (KVPool.read: for K/V pages [2, L, n, page_size, Hkv, D])."""
        return self.kv_pool.read(pages)

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        self.kv_pool.write(pages, data)

    # -- inspection (interop/bisect.py) ------------------------------------------------------------
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

        if (tp := self.placement.tp) is not None:
            raise NotImplementedError(f"forward_sequence(instrument=...) at tp_size={tp.size}:"
                                      " instrumented runs are single-device only so far")

        def run(params, kv, *inputs):
            model = self._model(params)
            finish = instrument(model)
            with counter_chain():
                hidden, _ = model(*inputs, kv)
            return hidden, finish()

        return jax.jit(run)(self._params, kv, *inputs)

    # -- startup -----------------------------------------------------------------------------------
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

    # -- the scheduler's page commands -------------------------------------------------------------
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
