"""`Engine`: the Python API (SGLang-shaped) around one scheduler, one model runner and one sampler.

Requests are validated synchronously in the caller's thread (bad input raises `InvalidRequest`, a
ValueError naming the field and value, and nothing is queued); the engine loop (engine_loop.py,
`EngineLoop`, a base class of `Engine`) runs in a background thread. Each step:

    scheduler.schedule() -> ScheduledStep (KV page transfers + StepBatch), run by step_executor:
      runner.execute_kv_transfers (copy-on-write, retraction saves, restores, in order)
      -> runner.forward -> hidden rows
      sampling rows:   runner.compute_logits -> sampler.sample / token_logprobs / top_logprobs
      prompt rows:     runner.compute_logits in chunks of --input-logprob-chunk-tokens rows
                       -> sampler.token_logprobs (the ONE logprob function, spec "Logprobs")
    -> commit each segment, append token ids, token-level stop checks (eos, stop_token_ids, length)
    -> one list of `StepOutput` events to the output processor's thread (output_processor.py), which
       detokenizes, matches stop strings (a match comes back as a "finish" command), builds the
       outputs and runs the callbacks, so none of that lengthens a step

An exception inside a step fails the requests of that step (finish_reason abort, with the message)
and the loop keeps serving the others.

Between steps the engine thread also runs the RL loop's commands (weight swaps, pause / continue,
memory release / resume); they, their public methods and their state are `RLControl`
(rl_control.py), the base class of `EngineLoop`. No step runs while paused or released.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import uuid
from typing import Any, Callable

from jengine.config import LaunchConfig, launch_config_from_kwargs
from jengine.engine.io_struct import (RequestHandle, RequestLimits, normalize_generate_args,
                                      validate_request)
from jengine.engine.kv_manager import KVManager
from jengine.engine.engine_loop import EngineLoop
from jengine.engine.host_gate import HostGate
from jengine.engine.step_executor import InFlightStep
from jengine.engine.output_processor import OutputProcessor, RequestState, StepOutput
from jengine.engine.request import InvalidRequest, Req
from jengine.engine.rl_control import _unwrap
from jengine.engine.scheduler import Scheduler
from jengine.launch import LaunchPlan

logger = logging.getLogger("jengine.engine")


class Engine(EngineLoop):
    def __init__(self, model_path: str = "tiny", numerics: str = "auto", **launch_options: Any) -> None:
        self._start(launch_config_from_kwargs(model_path, numerics=numerics, **launch_options))

    @classmethod
    def from_config(cls, cfg: LaunchConfig, *, replica: int | None = None) -> "Engine":
        """replica: with --dp-size M > 1, which of the server's M replicas this engine is (it
        runs on that replica's device group); jengine/server/replicas.py builds them."""
        eng = cls.__new__(cls)
        eng._start(cfg, replica)
        return eng

    def _start(self, cfg: LaunchConfig, replica: int | None = None) -> None:
        """The one launch path: resolve, load, plan, then build each part from its own config."""
        from jengine.numerics import resolve_launch

        resolved = resolve_launch(cfg)
        logging.getLogger("jengine").setLevel(resolved.config.log_level.upper())
        resolved.apply_environment()  # before anything touches a JAX device
        logger.info("%s", resolved.describe())
        for warning in resolved.warnings:
            logger.warning("%s", warning)
        logger.debug("resolved launch: %s", json.dumps(resolved.as_dict(), default=str, sort_keys=True))

        from jengine.engine.model_runner import ModelRunner
        from jengine.engine.sampler import Sampler
        from jengine.launch import plan_launch
        from jengine.models import IncrementalDetokenizer, load_model

        _enable_compilation_cache()
        devices = _replica_devices(resolved.config, replica)
        loaded = load_model(resolved.config.model_path)
        plan = plan_launch(resolved, loaded.config)  # refuses what the launch can't serve
        runner = ModelRunner(loaded.config, loaded.checkpoint, plan.runner, devices=devices)
        sampler = Sampler(plan.sampler, loaded.config.vocab_size)
        if not resolved.config.skip_warmup:
            t0 = time.perf_counter()
            runner.warmup()
            logger.info("warmup took %.1f s", time.perf_counter() - t0)
        tokenizer = loaded.tokenizer
        self._setup(plan=plan, model_config=loaded.config, tokenizer=tokenizer,
                    eos_token_ids=loaded.eos_token_ids, runner=runner, sampler=sampler,
                    detokenizer_factory=lambda prompt_ids: IncrementalDetokenizer(tokenizer, prompt_ids),
                    model_info={"model_dir": str(loaded.path)}, launch_weights=loaded.checkpoint)

    @classmethod
    def from_components(cls, **parts: Any) -> "Engine":
        """An engine over ready-made parts (tests use a fake runner and sampler). See `_setup`."""
        eng = cls.__new__(cls)
        eng._setup(**parts)
        return eng

    def _setup(self, *, plan: LaunchPlan, model_config: Any, tokenizer: Any, eos_token_ids: Any,
               runner: Any, sampler: Any, detokenizer_factory: Callable[[list[int]], Any],
               model_info: dict | None = None, launch_weights: Any = None) -> None:
        self.plan = plan
        self.resolved = plan.resolved  # the whole launch, for /get_server_info only
        self.config = plan.resolved.config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.runner = runner
        self.sampler = sampler
        self._eos_ids = frozenset(int(t) for t in (eos_token_ids or ()))
        self._detokenizer_factory = detokenizer_factory
        self._model_info = dict(model_info or {})
        self.max_context = plan.kv.max_context
        # The pool's pages are sized once, in the plan: the runner allocated them, the engine
        # hands them out.
        self.kv = KVManager(plan.kv.num_pages, plan.kv.page_size)
        self.request_limits = RequestLimits(
            max_context=self.max_context,
            input_vocab_size=int(getattr(model_config, "input_vocab_size", model_config.vocab_size)),
            vocab_size=int(model_config.vocab_size),
            pool_tokens=self.kv.capacity_pages * self.kv.page_size, page_size=self.kv.page_size,
            architecture=str(getattr(model_config, "architecture", "")),
            routes_experts=getattr(runner, "routing_shape", None) is not None)
        self.scheduler = Scheduler(plan.scheduler, self.kv)
        logger.info("KV pool: %d pages x %d tokens = %d tokens; context %d", self.kv.capacity_pages,
                    self.kv.page_size, self.kv.capacity_pages * self.kv.page_size, self.max_context)

        self._init_rl_control(runner, model_config, launch_weights)

        self._tracked: dict[str, RequestHandle] = {}  # in flight, by rid; guarded by _cv
        self._inbox: list[tuple[str, Any]] = []
        self._events: list[StepOutput] = []  # engine thread; handed over once per loop turn
        self._cv = threading.Condition()
        self._stopping = False
        self._counters = collections.Counter()
        self._step_latency: collections.deque[float] = collections.deque(maxlen=256)
        # --overlap-schedule: the dispatched step whose results the loop has not read yet
        self._overlap = plan.overlap_schedule
        self._in_flight: InFlightStep | None = None
        self.host_gate = HostGate()  # open while this engine's thread waits (host_gate.py)
        self.output_processor = OutputProcessor(self._finish_from_processor, self._on_request_finished,
                                                gate=self.host_gate, hold_s=plan.output_hold_s)
        self._thread = threading.Thread(target=self._loop, name="jengine-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------------------------
    # Public API
    # ---------------------------------------------------------------------------------------------
    def generate(self, prompt: Any = None, input_ids: Any = None, sampling_params: Any = None,
                 return_logprob: Any = False, logprob_start_len: Any = -1, top_logprobs_num: Any = 0,
                 rid: Any = None, return_routed_experts: Any = False) -> dict | list[dict]:
        """Blocking. A list in returns a list out, in order (n > 1: n entries per prompt).
        return_routed_experts (MoE models): the final output's meta_info["routed_experts"]
        (docs/serving.md, "Routed experts")."""
        items, batched = normalize_generate_args(self.tokenizer, prompt, input_ids, sampling_params,
                                                 return_logprob, logprob_start_len, top_logprobs_num, rid,
                                                 return_routed_experts)
        # Validate the whole batch before queueing any of it.
        groups = [self._validate(**item) for item in items]
        handles = self._enqueue(groups, stream=False, on_output=None)
        results: list[dict] = []
        for h in handles:
            out = h.result()
            results.extend(out if isinstance(out, list) else [out])
        return results if batched or len(results) != 1 else results[0]

    def submit(self, *, input_ids: Any, sampling_params: Any = None, return_logprob: bool = False,
               logprob_start_len: int = -1, top_logprobs_num: int = 0, rid: str | None = None,
               stream: bool = False, on_output: Callable[[dict], None] | None = None,
               return_routed_experts: bool = False) -> RequestHandle:
        """Non-blocking. on_output(out) runs in the output processor's thread (never the engine's):
        for every new token when stream is True (cumulative output dicts, in order), and always
        exactly once with the final output (finished=True)."""
        reqs = self._validate(input_ids=input_ids, sampling_params=sampling_params,
                              return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                              top_logprobs_num=top_logprobs_num, rid=rid,
                              return_routed_experts=return_routed_experts)
        return self._enqueue([reqs], stream=stream, on_output=on_output)[0]

    def abort(self, rid: str, message: str = "aborted by the client") -> bool:
        """Abort a request in flight (for n > 1, the base rid aborts every sample). Its pages are
        freed; its waiter gets a final output with finish_reason abort. False if none is in flight."""
        return self.abort_many([rid], message) > 0

    def abort_many(self, rids, message: str = "aborted by the client") -> int:
        """Abort every listed request (base rids included) in ONE engine command, however many:
        a client that leaves with 20000 samples in flight costs one step boundary, not 20000.
        ``message`` is the finish reason's message. Returns how many requests were aborted."""
        wanted = set(rids)
        with self._cv:
            targets = [r for r, h in self._tracked.items() if r in wanted or h.rid in wanted]
        if not targets:
            return 0
        if self.output_processor.in_processor_thread():
            for r in targets:  # from an on_output callback: cut the output where the caller saw it
                self.output_processor.abort_from_callback(r)
        return int(self._call("abort", (targets, message)) or 0)

    def flush_cache(self) -> bool:
        return bool(self._call("flush", None))

    def rebalance_experts(self) -> dict[str, Any]:
        """--enable-eplb: move every MoE layer's experts to the greedy placement of the load
        measured since the last rebalance (sharding/eplb.py), between two steps; requests in
        flight continue with the same bits. Returns {"load", "physical_to_logical"} per layer."""
        return _unwrap(self._call("rebalance_experts", None))

    def stats(self) -> dict[str, Any]:
        with self._cv:
            c = dict(self._counters)
            latency = list(self._step_latency)
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_used_tokens": self.kv.num_used * self.kv.page_size,
            "kv_total_tokens": self.kv.capacity_pages * self.kv.page_size,
            "cache_hit_tokens_total": self.scheduler.cache_hit_tokens_total,
            "retractions_total": self.scheduler.retractions_total,
            "prompt_tokens_total": c.get("prompt_tokens", 0),
            "generation_tokens_total": c.get("generation_tokens", 0),
            "requests_total": c.get("requests", 0),
            "step_latency_seconds": latency,
            **self._rl_stats(),
        }

    def server_info(self) -> dict[str, Any]:
        info = dict(self.resolved.as_dict())
        mc = self.model_config
        info.update(self._model_info)
        info.update({
            "architecture": getattr(mc, "architecture", None),
            "vocab_size": mc.vocab_size,
            "input_vocab_size": getattr(mc, "input_vocab_size", mc.vocab_size),
            "max_context": self.max_context,
            "page_size": self.kv.page_size,
            "kv_total_tokens": self.kv.capacity_pages * self.kv.page_size,
            "eos_token_ids": sorted(self._eos_ids),
            "warnings": list(self.resolved.warnings),
        })
        pool = getattr(self.runner, "kv_pool", None)
        if pool is not None:
            # What one token costs in the KV pool, over every layer: elements (the KV cache spec's
            # layout: K/V heads, or MLA's one latent) and bytes in the pool's dtype.
            info["kv_values_per_token"] = pool.spec.values_per_token
            info["kv_bytes_per_token"] = pool.spec.values_per_token * pool.dtype.itemsize
        parallelism = getattr(self.runner, "parallelism", None)
        if parallelism is not None:
            info["parallelism"] = {**parallelism(), "invariances": self._invariances()}
            local = getattr(self.runner, "scores_without_gather", None)
            if info["parallelism"]["layout"] != "replicated" and local is not None:
                info["parallelism"]["head_scoring"] = (
                    "vocab-parallel: greedy steps and prompt logprobs with no logits gather; "
                    "T > 0 draws gather their rows" if local(self.sampler) else
                    "gathered logits (the logprob order's blocks span ranks)")
        order = getattr(self.sampler, "logprob_order", None)
        if order is not None:
            # How the logprob order folds this vocabulary; a last block short of the width is
            # completed with -inf logits (docs/numerics.md, "Any vocabulary size").
            from pallas_kernels.logprobs import block_layout

            info["logprob_vocab_blocks"] = block_layout(order, int(mc.vocab_size))
        return info

    def _invariances(self) -> dict[str, bool]:
        """What this launch promises (docs/parallelism.md): run and batch invariance under a
        bitwise envelope at any layout; topology invariance (the TP1 bits at every TP size)
        needs every reduction site column-parallel (--tp-batch-invariant all) and GEMM leaves
        whose bits do not follow the column count (not the GPU's tiled Triton GEMM yet)."""
        bitwise = bool(self.resolved.bitwise)
        cfg = self.resolved.config
        topology = bitwise and (cfg.tp_size == 1 or (
            cfg.tp_batch_invariant == "all"
            and getattr(self.runner, "width_invariant_gemms", False)))
        return {"run": bitwise, "batch": bitwise, "topology": topology}

    def shutdown(self) -> None:
        with self._cv:
            if self._stopping:
                return
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()
        # Nothing in flight is silently lost: every waiter gets a final (aborted) output.
        for req in list(self.scheduler.running) + list(self.scheduler.waiting) + self._held:
            self._fail(req, "engine shut down")
        with self._cv:
            pending = [cmd for cmd in self._inbox if cmd[0] == "add"]
            self._inbox = []
        for _, req in pending:
            req.finish("abort", message="engine shut down")
            self._emit(req)
        self._flush_events()
        self.output_processor.shutdown()  # delivers every final output queued above

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---------------------------------------------------------------------------------------------
    # Admission (caller's thread)
    # ---------------------------------------------------------------------------------------------
    def _validate(self, *, rid: Any = None, **item: Any) -> list[Req]:
        return validate_request(self.request_limits, **item,
                                rid=uuid.uuid4().hex if rid is None else rid)

    def _enqueue(self, groups: list[list[Req]], *, stream: bool,
                 on_output: Callable | None) -> list[RequestHandle]:
        """Queue every group (one per prompt; n > 1 makes a group of n) or, on a rid clash, none."""
        rids = [r.rid for reqs in groups for r in reqs]
        handles = []
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shut down")
            clash = [r for i, r in enumerate(rids) if r in self._tracked or r in rids[:i]]
            if clash:
                raise InvalidRequest("rid", clash[0], "is already in flight")
            for reqs in groups:
                base_rid = reqs[0].rid if len(reqs) == 1 else reqs[0].rid.rsplit("-", 1)[0]
                handle = RequestHandle(base_rid, [r.rid for r in reqs], single=reqs[0].sampling.n == 1)
                handles.append(handle)
                for req in reqs:
                    req.stream = stream
                    # Registered with the processor before the engine can see it, so the
                    # processor knows the request before its first event arrives.
                    self.output_processor.add_request(RequestState.for_req(
                        req, self._detokenizer_factory(req.prompt_ids), handle, on_output))
                    self._tracked[req.rid] = handle
                    self._inbox.append(("add", req))
            self._cv.notify_all()
        return handles

    def _call(self, op: str, arg: Any) -> Any:
        """Run a command inside the engine thread (the scheduler is single-threaded) and wait."""
        # Callbacks run in the output processor's thread, so an abort() from one waits here safely.
        box: dict[str, Any] = {"done": threading.Event()}
        with self._cv:
            if self._stopping:
                return False
            self._inbox.append((op, (arg, box)))
            self._cv.notify_all()
        box["done"].wait()
        return box.get("result")


def _replica_devices(cfg: LaunchConfig, replica: int | None) -> tuple | None:
    """A replica's device group; None (the default device) for a plain engine."""
    from jengine.config import LaunchRefusal
    from sharding.mesh import replica_devices

    if cfg.dp_size == 1 and replica is None:
        return None
    if replica is None:
        raise LaunchRefusal(f"--dp-size {cfg.dp_size}: an Engine is one replica; serve "
                            f"{cfg.dp_size} data-parallel replicas with `jengine serve --dp-size "
                            f"{cfg.dp_size}` (docs/serving.md)")
    try:
        return replica_devices(cfg.dp_size, cfg.tp_size, replica, ep=cfg.ep_size)
    except ValueError as exc:
        raise LaunchRefusal(str(exc)) from None


def _enable_compilation_cache() -> None:
    """Persist compiled step buckets across restarts (JAX_COMPILATION_CACHE_DIR wins if set)."""
    import os

    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return
    from jengine.cache import cache_root

    jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax"))

