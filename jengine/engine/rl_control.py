"""The RL loop's commands to a running engine (docs/engine.md, "Weight updates, memory release,
pause"): weight updates, the weight version, pause / continue, and the release / resume of the
weights' and the KV pool's device memory.

`RLControl` is a part of `Engine` (a base class, so the public methods stay the Engine's own), with
all of the state these commands keep. Each command has two halves:

- the caller's thread checks the arguments and, for an update, builds the new parameter tuple next
  to the serving one (`weight_update.py` says what an update must satisfy), so a refusal changes
  nothing;
- the engine thread applies it between steps (`_queue_swap`, `_apply_waiting_swaps`, `_control`),
  because the scheduler and the runner are touched by that thread only.

By default a swap waits until the requests already submitted finish, and requests that arrive
meanwhile are held back (`_admit`), so no request sees two weight versions; while generation is
paused it applies at once. No step runs while paused or released (`_steps_blocked`).

What it uses of the Engine: `scheduler`, `runner`, `_call` (run a command in the engine thread and
wait), `_emit` (report a request finished outside a step) and `_drain` (resolve the step in flight
before a swap).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from jengine.engine.request import InvalidRequest, Req
from jengine.engine.weight_update import (CheckedReader, arrays_from_safetensors,
                                          arrays_from_tensors, launch_dtypes, read_update_checkpoint)
from jengine.models.fused_experts import CheckpointLayoutError
from jengine.models.layers.param import MappingReader

logger = logging.getLogger("jengine.engine")

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("kv_cache", "weights")


class EngineStateError(RuntimeError):
    """A command the engine's state refuses now (memory released, requests in flight): nothing
    changed; the message says what to do first."""


class RLControl:
    def _init_rl_control(self, runner: Any, model_config: Any, launch_weights: Any) -> None:
        # What each update is checked against: the model's checkpoint names and the launch
        # checkpoint's stored dtypes (a fresh launch from the update must load the same way).
        specs = runner.param_specs() if hasattr(runner, "param_specs") else {}
        names = {n for s in specs.values() for n in s.checkpoint_names}
        self._known_names = frozenset(names) | (
            {"lm_head.weight"} if getattr(model_config, "tie_word_embeddings", False) else set())
        self._launch_dtypes = launch_dtypes(launch_weights, names)
        # the served family reads other checkpoint layouts (fused experts); a test's fake runner
        # has no family, and its updates are read as they come
        self._family = getattr(runner, "family", None)
        self.weight_version = "default"
        self._update_lock = threading.Lock()  # one build (or release) next to the weights at a time
        self._paused: str | None = None  # a PAUSE_MODES entry while generation is paused
        self._released: set[str] = set()  # MEMORY_TAGS whose device memory is given back
        self._waiting_swaps: list[tuple[Any, dict]] = []  # until the requests in flight finish
        self._held: list[Req] = []  # requests that arrived while a swap waits: the new weights'
        self._flush_on_weight_change = True  # tests turn it off to show a stale cache is caught

    # ---------------------------------------------------------------------------------------------
    # Public API (caller's thread)
    # ---------------------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, *, abort_all_requests: bool = False,
                                 weight_version: str | None = None, flush_cache: bool = True,
                                 load_format: str | None = None) -> dict[str, Any]:
        """Load every weight from a model directory (safetensors, or Orbax from `jengine
        convert`) of the same model (config.json equal but for special ids; each tensor its
        launch name, shape and stored dtype). A refusal raises
        InvalidRequest naming the reason; the old weights keep serving."""
        _check_update_flags(abort_all_requests, weight_version, flush_cache, load_format)
        with self._update_lock:
            reader = read_update_checkpoint(model_path, self.model_config)
            params = self._build_params(reader, "model_path", partial=False)
        return self._swap(params, abort_all_requests, weight_version)

    def update_weights_from_tensor(self, named_tensors: Any, *, abort_all_requests: bool = False,
                                   weight_version: str | None = None, flush_cache: bool = True,
                                   load_format: str | None = None) -> dict[str, Any]:
        """Replace the named tensors (HF names; a dict or (name, tensor) pairs of torch, numpy or
        jax arrays, shared without a host copy where the device allows) and keep every other
        weight: one bucket of a bucketed update applies on its own, as SGLang's does."""
        _check_update_flags(abort_all_requests, weight_version, flush_cache, load_format)
        arrays = arrays_from_tensors(named_tensors)
        with self._update_lock:
            params = self._build_params(MappingReader(arrays), "named_tensors", partial=True)
        return self._swap(params, abort_all_requests, weight_version)

    def update_weights_from_safetensors(self, blobs: list[bytes], **options: Any) -> dict[str, Any]:
        """`update_weights_from_tensor` with the bucket as safetensors-encoded bytes (HTTP)."""
        return self.update_weights_from_tensor(
            arrays_from_safetensors(blobs, "serialized_named_tensors"), **options)

    def get_weight_version(self) -> str:
        return self.weight_version

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """Stop stepping. abort: every request in flight finishes with finish_reason abort;
        retract: running requests give their KV pages back (saved to host, restored when
        generation continues); in_place: requests keep their pages. New requests queue."""
        if mode not in PAUSE_MODES:
            raise InvalidRequest("mode", mode, f"must be one of {', '.join(PAUSE_MODES)}")
        return self._call_checked("pause", mode)

    def continue_generation(self) -> dict[str, Any]:
        return self._call_checked("continue", None)

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Give the device memory of `tags` (kv_cache, weights; None: both) back, now. Refused
        while requests hold what would be freed, unless generation is paused (kv_cache: paused
        with abort or retract). No step runs until they are resumed."""
        return self._call_checked("release", _memory_tags(tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Re-place the weights (the same bytes) and re-allocate the KV pool zeroed."""
        return self._call_checked("resume", _memory_tags(tags))

    def _build_params(self, reader: Any, field: str, *, partial: bool) -> tuple:
        if "weights" in self._released and partial:
            raise EngineStateError("the weights are released: resume_memory_occupation(tags="
                                   "['weights']) before a partial update")
        try:  # another layout the family reads (transformers 5's fused experts), as its names
            if self._family is not None:
                reader = self._family.read_checkpoint(self.model_config, reader)
        except CheckpointLayoutError as exc:
            raise InvalidRequest(field, exc.tensor, exc.reason,
                                 shown=f" tensor {exc.tensor!r}") from None
        checked = CheckedReader(reader, field=field, expected_dtypes=self._launch_dtypes,
                                known_names=self._known_names, require_all=not partial)
        try:
            return self.runner.build_params(checked, only=frozenset(checked.names()) if partial
                                            else None)
        except (ValueError, KeyError) as exc:  # a tensor's shape, or a missing tensor
            raise InvalidRequest(field, type(exc).__name__, str(exc).strip("'\""),
                                 shown=":") from None

    def _swap(self, params: tuple, abort_all: bool, version: str | None) -> dict[str, Any]:
        return _unwrap(self._call("swap", (params, abort_all, version)))

    def _call_checked(self, op: str, arg: Any) -> dict[str, Any]:
        with self._update_lock:  # never release weights a build is reading
            return _unwrap(self._call(op, arg))

    def _rl_stats(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "paused": self._paused,
                "memory_released": sorted(self._released)}

    # ---------------------------------------------------------------------------------------------
    # Engine thread, between steps
    # ---------------------------------------------------------------------------------------------
    def _steps_blocked(self) -> bool:
        return self._paused is not None or bool(self._released)

    def _admit(self, req: Req) -> None:
        """A new request: to the scheduler, or held back while a swap waits (it runs on the new
        weights, and the swap does not wait for it)."""
        if self._waiting_swaps:
            self._held.append(req)
        else:
            self.scheduler.add_request(req)

    def _take_held(self, rid: str) -> Req | None:
        for i, req in enumerate(self._held):
            if req.rid == rid:
                return self._held.pop(i)
        return None

    def _queue_swap(self, arg: tuple, box: dict) -> None:
        """The caller waits on `box` until the swap is applied (`_apply_waiting_swaps`)."""
        params, abort_all, version = arg
        if abort_all:
            self._abort_all("aborted for a weight update")
        self._waiting_swaps.append(((params, version), box))
        self._apply_waiting_swaps()

    def _unblock_swap_callers(self) -> None:
        """At shutdown: the callers of swaps never applied stop waiting (their result is None)."""
        for _, box in self._waiting_swaps:
            box["done"].set()

    def _abort_all(self, message: str) -> int:
        reqs = list(self.scheduler.running) + list(self.scheduler.waiting) + self._held
        self._held = []
        for req in reqs:
            self.scheduler.finish(req, cache_kv=False)
            req.finish("abort", message=message)
            self._emit(req)
        return len(reqs)

    def _apply_waiting_swaps(self) -> None:
        """Swap in updates once nothing in flight would see two weight versions -- at once while
        generation is paused (SGLang's partial rollout: paused requests continue on the new
        weights, their KV never cached)."""
        if not self._waiting_swaps or (self.scheduler.has_work() and self._paused is None):
            return
        self._drain()  # the step in flight (its requests all sealed or ended) runs on the old ones
        for (params, version), box in self._waiting_swaps:
            try:
                self.runner.swap_params(params)
                for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                    req.kv_reusable = False
                if self._flush_on_weight_change:
                    self.scheduler.flush_cache()  # no KV computed with the old weights is reused
                if version is not None:
                    self.weight_version = version
                self._released.discard("weights")
                box["result"] = {"success": True, "message": "weights updated",
                                 "weight_version": self.weight_version}
            except Exception as exc:
                logger.exception("weight swap failed")
                box["result"] = exc
            finally:
                box["done"].set()
        self._waiting_swaps = []
        for req in self._held:
            self.scheduler.add_request(req)
        self._held = []

    def _control(self, op: str, arg: Any) -> dict[str, Any]:
        """pause / continue / release / resume, between steps; a refusal is returned, not raised."""
        if op == "pause":
            count = 0
            if arg == "abort":
                count = self._abort_all("aborted by pause_generation")
            elif arg == "retract":
                count = len(self.scheduler.running)
                self.runner.execute_kv_transfers(self.scheduler.retract_all())
            self._paused = arg
            return {"success": True, "message": f"generation paused ({arg}); {count} request(s) "
                    f"{'aborted' if arg == 'abort' else 'retracted' if arg == 'retract' else 'kept'}"}
        if op == "continue":
            self._paused = None
            return {"success": True, "message": "generation continues"}
        if op == "release":
            busy = len(self.scheduler.running) + len(self.scheduler.waiting)
            if busy and self._paused is None:
                return EngineStateError(f"{busy} request(s) in flight: pause_generation first (or "
                                        "wait until they finish)")
            if "kv_cache" in arg and self.scheduler.running:
                return EngineStateError(f"{len(self.scheduler.running)} paused request(s) hold KV "
                                        "pages: pause_generation(mode='retract' or 'abort') first")
            if "kv_cache" in arg:
                self.scheduler.flush_cache()  # its pages are about to lose their bytes
                self.runner.kv_pool.release()
            if "weights" in arg:
                self.runner.release_weights()
            self._released |= set(arg)
            return {"success": True, "message": f"released {', '.join(arg)}"}
        if op == "resume":
            if "weights" in arg:
                self.runner.resume_weights()
            if "kv_cache" in arg:
                self.runner.kv_pool.resume()
            self._released -= set(arg)
            return {"success": True, "message": f"resumed {', '.join(arg)}"}
        raise ValueError(f"unknown engine command {op!r}")


def _unwrap(result: Any) -> Any:
    """A command's result as the caller sees it: the engine thread hands a refusal back as the
    exception to raise, and `_call` answers False once the engine is shut down."""
    if isinstance(result, Exception):
        raise result
    if result is False:
        raise RuntimeError("the engine is shut down")
    return result


def _check_update_flags(abort_all_requests: Any, weight_version: Any, flush_cache: Any,
                        load_format: Any) -> None:
    """SGLang's update options. flush_cache is accepted but the prefix cache is flushed on every
    weight change all the same: KV of the old weights must never be reused (docs/engine.md)."""
    for name, value in (("abort_all_requests", abort_all_requests), ("flush_cache", flush_cache)):
        if not isinstance(value, bool):
            raise InvalidRequest(name, value, "must be a bool")
    if weight_version is not None and not isinstance(weight_version, str):
        raise InvalidRequest("weight_version", weight_version, "must be a string or null")
    if load_format not in (None, "safetensors"):
        raise InvalidRequest("load_format", load_format, "must be null or 'safetensors' (the only "
                             "format read)")


def _memory_tags(tags: Any) -> tuple[str, ...]:
    if tags is None:
        return MEMORY_TAGS
    if not isinstance(tags, (list, tuple)) or not tags:
        raise InvalidRequest("tags", tags, f"must be a non-empty list of {', '.join(MEMORY_TAGS)} "
                             "(or null for all)")
    for i, tag in enumerate(tags):
        if tag not in MEMORY_TAGS:
            raise InvalidRequest(f"tags[{i}]", tag, f"must be one of {', '.join(MEMORY_TAGS)}")
    return tuple(dict.fromkeys(tags))
