"""The output processor: detokenization, stop strings, output dicts and callbacks, off the engine step.

The engine thread only records token ids and checks the token-level stop conditions (eos,
stop_token_ids, max_new_tokens, context length); per step it hands one list of cheap `StepOutput`
events to this processor's thread (vLLM v1's EngineCore -> OutputProcessor split). Here, per
request and in event order:

- the token ids, logprobs and prompt-logprob chunks are appended to a `RequestState` that only this
  thread touches (so building an output never races the engine appending to its `Req`);
- the tokens are detokenized incrementally and checked against the stop strings;
- streamed (cumulative) and final output dicts are built and the `on_output` callbacks run.

A step's events wait while the engine thread is busy scheduling and dispatching (its host gate is
closed), for at most --output-hold-ms, so this thread and the stream events its callbacks wake take
the GIL while the engine thread waits for the device instead (host_gate.py).

A stop-string match is found here, possibly a few steps after the engine sampled the completing
token. The processor then truncates the request's output at that token (exactly what a
synchronous check would have returned), asks the engine to finish the request (free its pages,
offer its KV to the prefix cache), and ignores any later events for it: the tokens the engine
sampled meanwhile are discarded.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from jengine.engine.host_gate import HostGate
from jengine.engine.io_struct import RequestHandle, build_output
from jengine.engine.request import Req, SamplingParams

logger = logging.getLogger("jengine.engine")


@dataclass
class StepOutput:
    """What the engine reports for one request after one step (vLLM's EngineCoreOutput)."""

    rid: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)  # only when return_logprob
    new_top_logprobs: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None  # set once the engine finished the request
    cached_tokens: int = 0
    weight_version: str = ""  # the weights this step ran with
    routed_experts: np.ndarray | None = None  # int32[n, layers, k] of positions routed_start..
    routed_start: int = 0

    @classmethod
    def for_segment(cls, req: Req, res: Any, sampled: bool) -> "StepOutput":
        """The event for one committed segment (res: step_executor.SegmentResult). Only
        references and slices of the step's arrays: no copies of the request's history."""
        n_top = req.top_logprobs_num
        ev = cls(req.rid, prompt_logprobs=list(res.prompt_logprobs),
                 prompt_top_logprobs=[(v[:n_top], t[:n_top]) for v, t in res.prompt_tops],
                 finish_reason=req.finish_reason, cached_tokens=req.cached_tokens,
                 routed_experts=res.routed_experts, routed_start=res.routed_start)
        if sampled:
            ev.new_token_ids = [res.token]
            if req.return_logprob:
                ev.new_logprobs = [res.token_logprob]
                if res.token_top is not None:
                    top_vals, top_ids = res.token_top
                    ev.new_top_logprobs = [(top_vals[:n_top], top_ids[:n_top])]
        return ev


@dataclass(eq=False)
class RequestState:
    """The processor's view of one request: everything the output dict is built from.

    Field names match `build_output`'s needs (and SGLang's meta_info), so the dict is the same one
    the engine built before this split.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_routed_experts: bool
    stream: bool
    detokenizer: Any
    handle: RequestHandle | None = None
    on_output: Callable[[dict], None] | None = None

    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    weight_version: str = ""
    input_token_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    # Expert ids of positions 0, 1, ... in arrival order (a chunk per step); see `routed_rows`.
    routed_experts: list[np.ndarray] = field(default_factory=list)
    routed_count: int = 0

    @classmethod
    def for_req(cls, req: Req, detokenizer: Any, handle: RequestHandle | None = None,
                on_output: Callable[[dict], None] | None = None) -> "RequestState":
        return cls(rid=req.rid, prompt_ids=req.prompt_ids, sampling=req.sampling,
                   return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
                   top_logprobs_num=req.top_logprobs_num,
                   return_routed_experts=req.return_routed_experts, stream=req.stream,
                   detokenizer=detokenizer,
                   handle=handle, on_output=on_output)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, ev: StepOutput) -> bool:
        """Fold one event in. Returns True when a stop string finished the request here."""
        self.cached_tokens = ev.cached_tokens
        self.weight_version = ev.weight_version or self.weight_version
        self.input_token_logprobs.extend(ev.prompt_logprobs)
        self.input_top_logprobs.extend(ev.prompt_top_logprobs)
        if ev.routed_experts is not None:
            # Positions arrive in order (no prefix-cache hit; a retraction resumes from its saved
            # KV, recomputing nothing): anything else would misplace every later token's ids.
            if ev.routed_start != self.routed_count:
                raise RuntimeError(f"routed experts of positions {ev.routed_start}.. arrived after "
                                   f"{self.routed_count} positions")
            self.routed_experts.append(ev.routed_experts)
            self.routed_count += len(ev.routed_experts)
        reason = ev.finish_reason
        # eos / stop_token_ids: the stop token is recorded but its text is not part of `text`.
        stopped_by_token = reason is not None and reason["type"] == "stop" and not isinstance(
            reason.get("matched"), str)
        stopped_by_string = False
        for i, token in enumerate(ev.new_token_ids):
            self.output_ids.append(token)
            if self.return_logprob:
                self.output_token_logprobs.append(ev.new_logprobs[i])
                if i < len(ev.new_top_logprobs):
                    self.output_top_logprobs.append(ev.new_top_logprobs[i])
            if stopped_by_token and i == len(ev.new_token_ids) - 1:
                break
            delta = self.detokenizer.add(token)
            self.text += delta
            if self.sampling.stop and self.check_stop_strings(len(delta)):
                stopped_by_string = True
                break  # truncate here: later tokens of this event are discarded
        if not stopped_by_string and reason is not None:
            self.finish_reason = reason
        if self.finished and not isinstance(self.finish_reason.get("matched"), str):
            self.text += self.detokenizer.flush()  # text held back for an incomplete character
        return stopped_by_string

    def routed_rows(self) -> np.ndarray:
        """int32[n, layers, k]: the expert ids of every position the model ran for this request --
        the prompt and every output token but the last (never fed back), as SGLang's seqlen - 1;
        a prompt-only request (max_new_tokens=0) has all its prompt positions."""
        if not self.routed_experts:  # aborted before its first step
            return np.zeros((0,), np.int32)
        n = self.prompt_len + max(len(self.output_ids) - 1, 0)
        return np.concatenate(self.routed_experts)[:n]

    def check_stop_strings(self, delta_len: int) -> bool:
        """After `delta_len` new characters: finish at the first stop string, trimming it (and
        everything after it) from the text unless no_stop_trim."""
        stops = self.sampling.stop
        window_start = max(0, len(self.text) - delta_len - max(len(s) for s in stops) + 1)
        hits = [(at, s) for s in stops if (at := self.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        self.text = self.text[: at + len(stop)] if self.sampling.no_stop_trim else self.text[:at]
        self.finish_reason = {"type": "stop", "matched": stop}
        return True


class OutputProcessor:
    """Owns the `RequestState`s and the thread that turns engine events into outputs.

    `finish_request(rid)` is how a stop-string match reaches the engine; `on_finished(state)` runs
    just before a final output is delivered (the engine forgets the rid there, so a caller that
    resubmits the same rid right after `result()` is not refused as "in flight").
    """

    def __init__(self, finish_request: Callable[[str], None],
                 on_finished: Callable[[RequestState], None], gate: HostGate | None = None,
                 hold_s: float = 0.0) -> None:
        self._finish_request = finish_request
        self._on_finished = on_finished
        self._gate = gate or HostGate()  # the engine thread's (host_gate.py)
        self._hold_s = hold_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._states: dict[str, RequestState] = {}  # this thread only
        self._aborted_in_callback: list[str] = []  # this thread only
        self._thread = threading.Thread(target=self._loop, name="jengine-output", daemon=True)
        self._thread.start()

    # Called from other threads: everything goes through the queue, so per-request order holds
    # (a request is registered before the engine can see it, hence before its first event).
    def add_request(self, state: RequestState) -> None:
        self._queue.put(("add", state))

    def put(self, events: list[StepOutput]) -> None:
        if events:
            self._queue.put(("events", events))

    def in_processor_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def abort_from_callback(self, rid: str) -> None:
        """An on_output callback aborted `rid`: finish it right after that callback returns, so its
        final output holds exactly the tokens the caller had seen (the engine may be ahead)."""
        self._aborted_in_callback.append(rid)

    def shutdown(self) -> None:
        """Deliver everything queued so far, then stop."""
        self._queue.put(("stop", None))
        self._thread.join()

    # The processor thread.
    def _loop(self) -> None:
        while True:
            kind, payload = self._queue.get()
            if kind == "stop":
                return
            if kind == "add":
                self._states[payload.rid] = payload
                continue
            self._gate.hold(self._hold_s)  # out of the engine thread's way while it works
            for ev in payload:
                try:
                    self._process(ev)
                except Exception:
                    logger.exception("output processing of request %s failed", ev.rid)
                    self._fail(ev.rid, "output processing failed")
                while self._aborted_in_callback:
                    self._fail(self._aborted_in_callback.pop(0), "aborted by the client")

    def _process(self, ev: StepOutput) -> None:
        state = self._states.get(ev.rid)
        if state is None:
            return  # already finished (a stop string matched): the engine ran ahead; discard
        if state.apply(ev):
            self._finish_request(ev.rid)
        if state.finished:
            self._deliver(state)
        elif state.stream and ev.new_token_ids:
            self._deliver(state)

    def _fail(self, rid: str, message: str) -> None:
        state = self._states.get(rid)
        if state is None:
            return
        if not state.finished:
            state.finish_reason = {"type": "abort", "message": message}
            self._finish_request(rid)
        self._deliver(state)

    def _deliver(self, state: RequestState) -> None:
        out = build_output(state)
        if state.finished:
            self._states.pop(state.rid, None)
            self._on_finished(state)
        if state.on_output is not None:
            try:
                state.on_output(out)
            except Exception:
                logger.exception("on_output callback of request %s raised", state.rid)
        if state.finished and state.handle is not None:
            state.handle._set(state.rid, out)
