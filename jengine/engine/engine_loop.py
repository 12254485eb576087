"""The engine thread's loop: commands, steps and outputs, in one thread (the scheduler is
single-threaded and never touches the device; step_executor.py does).

Each turn takes the inbox (admissions, aborts, flushes, the RL loop's commands), applies weight
swaps that are due, then schedules and dispatches one step. With the overlap schedule (the default)
the step in flight is resolved only after the next one is dispatched: `_commit_ahead` lets the
scheduler build step N+1 on step N's outcome before its tokens are known (placeholders the device
fills, requests that end whatever their token is sealed), so the device never waits on this thread.
Without it each step is resolved at once. Either way a request's tokens and logprobs are the same
bits (the invariance harness's `overlap-off` mode; docs/engine.md, "Overlap schedule").

`Engine` (engine.py) is the public API on top: construction, admission in the caller's thread,
stats and shutdown. `EngineLoop` holds no state of its own; `Engine._setup` creates it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from jengine.engine.batch import placeholder
from jengine.engine.loop_clock import NO_CLOCK, LoopClock
from jengine.engine.output_processor import RequestState, StepOutput
from jengine.engine.request import Req
from jengine.engine.rl_control import RLControl
from jengine.engine.scheduler import ScheduledStep, Segment
from jengine.engine.step_executor import InFlightStep, SegmentResult, dispatch_step

logger = logging.getLogger("jengine.engine")


class EngineLoop(RLControl):
    _clock = NO_CLOCK  # LoopClock once time_host_phases() is called

    # ---------------------------------------------------------------------------------------------
    # The loop (engine thread)
    # ---------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._stopping or self._can_step()
                           or self._in_flight is not None):
                    self.host_gate.open()  # idle: nothing of this thread's to get out of the way of
                    self._cv.wait()
                self.host_gate.close()
                stopping = self._stopping
                inbox, self._inbox = ([], self._inbox) if stopping else (self._inbox, [])
            clock = self._clock
            clock.start()
            if stopping:
                self._drain()  # its sealed requests finish; shutdown fails the rest
                self.host_gate.open()
                with self._cv:
                    for op, payload in self._inbox:  # release anyone blocked in _call
                        if op not in ("add", "finish"):  # the ones a caller waits on
                            payload[1]["done"].set()
                    self._unblock_swap_callers()
                return
            if any(op != "add" for op, _ in inbox):
                self._drain()  # a command sees no step in flight: no placeholder, nothing sealed
            for op, payload in inbox:
                try:
                    self._handle(op, payload)
                except Exception:  # keep serving; the command's caller has been released
                    logger.exception("engine command %r failed", op)
            self._apply_waiting_swaps()
            clock.lap("other")
            stepped = True
            if self._can_step():
                self._step()
                self._apply_waiting_swaps()
            elif self._in_flight is not None:
                self._drain()
                self._apply_waiting_swaps()
            else:
                stepped = False
            clock.lap("other")
            self._flush_events()
            clock.lap("emit")
            clock.end(stepped)

    def time_host_phases(self) -> None:
        """Time each phase of the loop from the next turn on (jengine/engine/loop_clock.py);
        `host_phases()` reports them."""
        self._gate_since = self.host_gate.stats()
        self._clock = LoopClock()

    def host_phases(self) -> dict:
        """Median host ms per loop phase since `time_host_phases()` ({} if never called), and
        what the output processor waited at the host gate meanwhile."""
        if not isinstance(self._clock, LoopClock):
            return {}
        since = self._gate_since
        now = self.host_gate.stats()
        return {**self._clock.summary(), **{k: v - since.get(k, 0) for k, v in now.items()}}

    def _can_step(self) -> bool:
        return self.scheduler.has_work() and not self._steps_blocked()

    def _flush_events(self) -> None:
        events, self._events = self._events, []
        self.output_processor.put(events)

    def _handle(self, op: str, payload: Any) -> None:
        if op == "add":
            self._admit(payload)
            return
        if op == "finish":
            # The processor already delivered the final output (stop string, or abort from a
            # callback) and discards tokens sampled since; free pages and cache KV as usual.
            req = self.scheduler.find(payload)
            if req is not None and not req.finished:
                self.scheduler.finish(req)
                req.finish("stop", message="finished by the output processor")
            return
        arg, box = payload
        try:
            if op == "abort":
                rids, message = arg
                aborted = 0
                for rid in rids:
                    req = self.scheduler.find(rid) or self._take_held(rid)
                    if req is not None:
                        self.scheduler.finish(req)
                        req.finish("abort", message=message)
                        self._emit(req)
                        aborted += 1
                box["result"] = aborted
            elif op == "flush":
                self.scheduler.flush_cache()
                box["result"] = True
            elif op == "rebalance_experts":
                box["result"] = self.runner.rebalance_experts()
            elif op == "swap":
                self._queue_swap(arg, box)
                return  # the caller is released when the swap is applied
            else:
                box["result"] = self._control(op, arg)
        except Exception as exc:
            box["result"] = exc
            raise
        finally:
            if op != "swap" or "result" in box:  # a queued swap is released when applied
                box["done"].set()

    def _step(self) -> None:
        """Schedule and dispatch the next step; resolve the one in flight (if any) after the
        dispatch, so the device never waits on this thread (docs/engine.md, "Overlap schedule").
        Without --overlap-schedule the new step is resolved at once: today's synchronous loop."""
        t0 = time.perf_counter()
        try:
            step = self.scheduler.schedule()
        except Exception as exc:  # a scheduler bug: fail what it was holding, keep serving
            logger.exception("scheduling failed")
            for req in list(self.scheduler.running):
                self._fail(req, f"scheduling failed: {exc!r}")
            return
        finally:
            for req in self.scheduler.finished_by_scheduler:
                self._emit(req)
            self.scheduler.finished_by_scheduler.clear()
            self._clock.lap("schedule")
        previous, self._in_flight = self._in_flight, None
        flight = self._dispatch(step, previous)
        self._clock.lap("dispatch")
        if previous is not None:
            self._resolve(previous)
        if flight is None or step.batch is None:
            return  # failed, or page transfers only: nothing to resolve
        flight.started = t0
        if self._overlap:
            self._commit_ahead(flight)
            self._clock.lap("commit")
            self._in_flight = flight
        else:
            self._resolve(flight)

    def _dispatch(self, step: ScheduledStep, previous: InFlightStep | None) -> InFlightStep | None:
        placeholders = step.batch is not None and bool((step.batch.input_ids < 0).any())
        if placeholders and previous is None:  # an engine bug: say so rather than feed garbage
            raise RuntimeError("a step reads placeholder tokens, but no step is in flight")
        try:
            return dispatch_step(self.runner, self.sampler, step,
                                 self.plan.input_logprob_chunk_tokens,
                                 previous.tokens if placeholders else None)
        except Exception as exc:
            logger.exception("step failed; aborting its %d request(s)", len(step.segments))
            for seg in step.segments:
                self._fail(seg.req, f"step failed: {exc!r}")
            # A retracted request whose save did not run has no bytes to resume from.
            for req in list(self.scheduler.waiting):
                if req.image is not None and not req.image.saved:
                    self._fail(req, f"step failed before its KV was saved: {exc!r}")
            return None

    def _commit_ahead(self, flight: InFlightStep) -> None:
        """Overlap: the scheduler may build the next step on the dispatched one's outcome before
        its tokens are known. Its frontiers advance (its K/V will be written before any later step
        reads them: JAX runs the steps in dispatch order), each sampled token is a placeholder the
        next step's row reads on the device, and a request its pending token ends whatever it is
        (max_new_tokens, the context, a prompt-only request) is sealed: released now, exactly as
        the synchronous loop would release it after this step, and finished when resolved."""
        index = {id(seg): i for i, seg in enumerate(flight.sampled)}
        for seg in flight.step.segments:
            req = seg.req
            if req.finished:
                continue  # ended by the step resolved just before; this row is discarded
            self.scheduler.commit(seg)
            if seg.sample:
                req.output_ids.append(placeholder(index[id(seg)]))
                ends = req.ends_whatever_token(self.max_context)
            else:
                ends = req.num_computed == req.num_tokens and req.sampling.max_new_tokens == 0
            if ends:
                self.scheduler.finish(req)  # the tokens it caches are known: the last is not
                req.sealed = True
        flight.committed = True

    def _drain(self) -> None:
        """Resolve the step in flight, if any."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None:
            self._resolve(flight)

    def _resolve(self, flight: InFlightStep) -> None:
        """Wait for a dispatched step's results; tokens, stop checks and events, in segment order."""
        step = flight.step
        self.host_gate.open()  # the device's time: the output processor may run (host_gate.py)
        try:
            results = flight.resolve()
        except Exception as exc:
            logger.exception("step failed; aborting its %d request(s)", len(step.segments))
            for seg in step.segments:
                self._fail(seg.req, f"step failed: {exc!r}")
            return
        finally:
            self.host_gate.close()
            self._clock.lap("wait")
        generated = 0
        for seg in step.segments:
            if seg.req.finished:
                # Finished after this step was built: aborted, failed, or (overlap) an eos that
                # the step before it sampled. Its row is discarded; nothing is emitted.
                continue
            try:
                generated += self._process(seg, results[id(seg)], committed=flight.committed)
            except Exception as exc:
                logger.exception("post-processing request %s failed", seg.req.rid)
                self._fail(seg.req, f"post-processing failed: {exc!r}")
        with self._cv:  # once per step, not per row
            self._counters["generation_tokens"] += generated
            self._step_latency.append(time.perf_counter() - flight.started)
        self._clock.lap("process")

    def _process(self, seg: Segment, res: SegmentResult, committed: bool) -> int:
        """committed: `_commit_ahead` already advanced the frontier and appended a placeholder.
        Returns the number of tokens generated (0 or 1)."""
        req = seg.req
        if not committed:
            self.scheduler.commit(seg)
        if seg.sample:
            (req.resolve_token if committed else req.append_token)(
                res.token, eos_token_ids=self._eos_ids, max_context=self.max_context)
        elif req.num_computed == req.num_tokens and req.sampling.max_new_tokens == 0:
            req.finish("length")  # teacher forcing / prompt scoring: nothing to generate
        if req.sealed and not req.finished:
            raise RuntimeError(f"request {req.rid} was sealed but its token did not end it")
        if req.finished and not req.sealed:
            self.scheduler.finish(req)
        ev = StepOutput.for_segment(req, res, sampled=seg.sample)
        ev.weight_version = self.weight_version
        if ev.new_token_ids or ev.finish_reason or ev.prompt_logprobs or ev.routed_experts is not None:
            self._events.append(ev)
        return int(seg.sample)

    # ---------------------------------------------------------------------------------------------
    # Outputs
    # ---------------------------------------------------------------------------------------------
    def _fail(self, req: Req, message: str) -> None:
        if req.finished:
            return
        try:
            self.scheduler.finish(req, cache_kv=False)
        except Exception:  # never let cleanup take the loop down
            logger.exception("releasing request %s failed", req.rid)
        req.finish("abort", message=message)
        self._emit(req)

    def _emit(self, req: Req) -> None:
        """Report a request finished outside a sampled step (abort, failure, scheduler refusal)."""
        self._events.append(StepOutput(req.rid, finish_reason=req.finish_reason,
                                       cached_tokens=req.cached_tokens,
                                       weight_version=self.weight_version))

    def _finish_from_processor(self, rid: str) -> None:
        """(Output processor's thread.) Queued, not waited for: it must never block on a step."""
        with self._cv:
            if not self._stopping:
                self._inbox.append(("finish", rid))
                self._cv.notify_all()

    def _on_request_finished(self, state: RequestState) -> None:  # output processor's thread
        with self._cv:
            self._tracked.pop(state.rid, None)
            self._counters["requests"] += 1
            self._counters["prompt_tokens"] += state.prompt_len
