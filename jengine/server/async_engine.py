"""The engine as the asyncio event loop sees it.

The Engine runs its scheduler loop in its own thread and reports each request's outputs through an
`on_output` callback called from the engine's output-processor thread. `AsyncEngine` hands each
output to the request's `RequestStream`, which the HTTP handler reads; the streams offered an
output since the event loop last looked are woken together (`LoopWakeups`: one
`loop.call_soon_threadsafe` per batch, not per request). Outputs are cumulative (each holds the whole output so far), so a stream keeps
only the newest one its reader has not taken yet, as SGLang's TokenizerManager does
(`out_list[-1]`): a reader that keeps up gets every token in its own event; one that falls behind
(the event loop busy with 256 streams, a slow client) gets the tokens it missed in its next event
instead of a backlog of events to encode and send, each holding the whole output again. Tokenization, chat templating and engine calls that may wait on the engine's lock run in a
small thread pool, so neither the event loop nor the engine step waits on them.

It also keeps the set of requests in flight, which is what abort-on-disconnect and graceful
shutdown act on, and their work against the admission bounds (admission.py). Aborts are
coalesced: every abort asked for while one is being carried out goes to the engine in the next
single `abort_many` call, so a client leaving with 20000 samples in flight costs one engine step
boundary, and the control pool is never queued behind thousands of single aborts.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from jengine.server.admission import AdmissionLimits, WorkQueue
from jengine.engine.request import InvalidRequest
from jengine.server.errors import RequestError

logger = logging.getLogger(__name__)


class Update:
    """One engine output as the routes use it: the request's output so far (`out`, SGLang shape,
    cumulative) and what it added since the output before (`prev`). The deltas are computed when a
    route asks for them (OpenAI's streams do; /generate's cumulative stream does not), since this
    runs on the event loop once per streamed token per request."""

    __slots__ = ("out", "prev")

    def __init__(self, out: dict, prev: dict | None):
        self.out = out
        self.prev = prev

    @property
    def finished(self) -> bool:
        return bool(self.out.get("finished"))

    @property
    def new_text(self) -> str:
        return self.out.get("text", "")[len(self.prev["text"]) if self.prev else 0:]

    @property
    def new_ids(self) -> list[int]:
        return list(self.out.get("output_ids", ())[self._done_ids:])

    @property
    def new_logprobs(self) -> list:
        """(logprob, token_id, None) per new token; [] without return_logprob."""
        return self._new("output_token_logprobs")

    @property
    def new_top_logprobs(self) -> list:
        """Per new token, its top-k triples; [] without top_logprobs_num."""
        return self._new("output_top_logprobs")

    @property
    def _done_ids(self) -> int:
        return len(self.prev["output_ids"]) if self.prev else 0

    def _new(self, key: str) -> list:
        return list((self.out.get("meta_info", {}).get(key) or ())[self._done_ids:])


class LoopWakeups:
    """Streams to wake on one event loop, batched: the engine thread offers every running request
    an output per step, and one `call_soon_threadsafe` (one write to the loop's self-pipe, one
    callback) per batch instead of one per request costs both threads less of the GIL they share
    (scripts/stream_fanout_bench.py: 256 streams).

    With the engine's host gate (jengine/engine/host_gate.py), streams are woken `CHUNK` at a time,
    and while the engine thread is scheduling and dispatching (the gate closed) the rest wait for
    its next device wait, at most `hold_s`: the events those streams encode and send would
    otherwise take the GIL from it, one switch interval at a time."""

    CHUNK = 16  # ~0.6 ms of stream events on the H200 host: how late the engine thread may get it

    def __init__(self, loop: asyncio.AbstractEventLoop, gate: Any = None, hold_s: float = 0.0):
        self.loop = loop
        self._gate = gate if hold_s > 0 else None
        self._hold_s = hold_s
        self._lock = threading.Lock()
        self._pending: list[RequestStream] = []  # offered, not yet seen by the loop
        self._ready: collections.deque[RequestStream] = collections.deque()  # the loop's, to wake
        self._deferred_until: float | None = None  # the loop's clock, while deferring for the gate
        self._resume: asyncio.TimerHandle | None = None

    def add(self, stream: "RequestStream") -> None:
        with self._lock:
            self._pending.append(stream)
            first = len(self._pending) == 1  # else a flush is scheduled and has not run yet
        if first:
            self._call_soon_threadsafe(self._flush)

    def _call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        try:
            self.loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop closed under us during shutdown; nobody is listening
            pass

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        self._ready.extend(pending)
        self._wake_some()

    def _wake_some(self) -> None:
        """Wake up to CHUNK streams, and come back for the rest once their events are sent (or,
        the gate closed, when it opens or the hold runs out)."""
        if not self._ready:
            return
        gate = self._gate
        if gate is not None and not gate.is_open():
            now = self.loop.time()
            if self._deferred_until is None:
                self._deferred_until = now + self._hold_s
            if now < self._deferred_until:
                if self._resume is None:  # one resume in the air at a time
                    self._resume = self.loop.call_at(self._deferred_until, self._resumed)
                    gate.call_when_open(lambda: self._call_soon_threadsafe(self._resumed))
                return
        else:
            self._deferred_until = None
        for _ in range(min(self.CHUNK, len(self._ready))):
            self._ready.popleft()._wake()
        if self._ready:
            self.loop.call_soon(self._wake_some)  # after the woken streams' steps
        else:
            self._deferred_until = None  # the next batch gets its own hold

    def _resumed(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._wake_some()


class RequestStream:
    """One submitted request: its outputs arrive through `offer` (any thread); `updates()` yields
    them, the newest each time (module docstring), the last with `finished` True."""

    def __init__(self, owner: "AsyncEngine", rid: str, wakeups: LoopWakeups):
        self.owner = owner
        self.rid = rid
        self.finished = False
        self.last: dict | None = None  # cumulative output so far
        self.arrival = time.monotonic()
        self._wakeups = wakeups
        self._lock = threading.Lock()
        self._newest: dict | None = None  # offered, not yet taken by `updates`
        self._wake_pending = False  # a `_wake` is scheduled on the loop and has not run yet
        self._ready = asyncio.Event()

    def offer(self, out: dict) -> None:
        """The engine's output-processor thread: `out` replaces any output not yet taken."""
        with self._lock:
            self._newest = out
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            self._wakeups.add(self)

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False  # an output offered from here on schedules another wake
        self._ready.set()

    async def updates(self) -> AsyncIterator[Update]:
        """Yield every output until the final one. If the consumer stops early (client gone,
        task cancelled), the request is aborted so its KV pages are freed."""
        ready, lock = self._ready, self._lock
        try:
            while not self.finished:
                await ready.wait()
                ready.clear()
                with lock:
                    out, self._newest = self._newest, None
                if out is None:  # a wake whose output an earlier wake already handed over
                    continue
                update = Update(out, self.last)
                self.owner._observe(self, update)
                self.finished = update.finished
                self.last = out
                yield update
        finally:
            if not self.finished:
                self.abort()
            self.owner._forget(self.rid)

    async def final(self) -> dict:
        async for _ in self.updates():
            pass
        assert self.last is not None
        return self.last

    def abort(self) -> None:
        self.owner.abort_soon(self.rid)


SHUTDOWN_MESSAGE = "server shutting down"


class AsyncEngine:
    def __init__(self, engine: Any, metrics: Any = None, tokenizer_threads: int = 2,
                 admission: AdmissionLimits | None = None):
        self.engine = engine
        self.admission = admission or AdmissionLimits()
        # Every data-parallel replica has its own running set (jengine/server/replicas.py).
        running = int(engine.plan.scheduler.max_running_requests) * int(engine.config.dp_size)
        self.work = WorkQueue(self.admission, running)
        self._pending_aborts: dict[str, str] = {}  # rid -> message, for the next abort_many
        self._abort_lock = threading.Lock()
        self._abort_flush_scheduled = False
        self.metrics = metrics  # ServerMetrics: latency histograms observed per request
        self.tokenizer = engine.tokenizer
        # Tokenization and submission share one pool; calls that wait for the engine thread to
        # reach them (abort, flush, info) get their own, so a burst of aborts (each waiting up to a
        # step) never delays tokenizing someone else's prompt.
        self._pool = ThreadPoolExecutor(max_workers=tokenizer_threads,
                                        thread_name_prefix="jengine-tokenize")
        self._control_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="jengine-control")
        self._in_flight: dict[str, RequestStream] = {}
        self._wakeups: LoopWakeups | None = None  # for the loop requests are submitted on
        self._token_text: dict[int, str] = {}
        self.draining = False  # set on shutdown: new requests get 503

    # -- work off the event loop ------------------------------------------------------------------
    async def run_blocking(self, fn: Callable, *args, **kwargs) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def run_control(self, fn: Callable, *args, **kwargs) -> Any:
        """An engine call that may wait for the current step (flush_cache, server_info, ...)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._control_pool, lambda: fn(*args, **kwargs))

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (a rendered chat already carries its special tokens: pass
        add_special_tokens=False, as HF's apply_chat_template(tokenize=True) does)."""
        return await self.run_blocking(lambda: [
            self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts])

    async def chat_prompt(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return await self.run_blocking(self.tokenizer.apply_chat_template, messages,
                                       add_generation_prompt=add_generation_prompt)

    async def token_texts(self, ids: list[int]) -> list[str]:
        """Each token decoded on its own (what OpenAI logprobs call `token`); cached per id."""
        missing = [i for i in set(ids) if i not in self._token_text]
        if missing:
            decoded = await self.run_blocking(lambda: {
                i: self.tokenizer.decode([i], skip_special_tokens=False) for i in missing})
            self._token_text.update(decoded)
        return [self._token_text[i] for i in ids]

    # -- requests -----------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def submit(self, *, input_ids: list[int], sampling_params: dict, rid: str | None = None,
                     return_logprob: bool = False, logprob_start_len: int = -1,
                     top_logprobs_num: int = 0, stream: bool = False,
                     admit: bool = True) -> RequestStream:
        """Submit one request (admission-checked unless ``admit`` is False: /health_generate's
        probe). The engine validates synchronously; its InvalidRequest becomes a 400 naming the
        field."""
        return (await self.submit_all([dict(
            input_ids=input_ids, sampling_params=sampling_params, rid=rid,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, stream=stream)], admit=admit))[0]

    async def submit_all(self, items: list[dict], admit: bool = True) -> list[RequestStream]:
        """Submit a batch whole or not at all: admission first (503 if it cannot fit now), then each
        item; if the engine refuses one, the ones already admitted are aborted."""
        if self.draining:
            raise RequestError("server is shutting down; not admitting new requests", status=503)
        items = [{**it, "rid": it.get("rid") or uuid.uuid4().hex} for it in items]
        seen: set[str] = set()
        for it in items:
            if it["rid"] in self._in_flight or it["rid"] in seen:
                raise RequestError(f"rid={it['rid']!r} is already in flight", "rid", it["rid"])
            seen.add(it["rid"])
        if admit:
            self.work.reserve(items)  # synchronous on the loop: atomic against other requests
        handles: list[RequestStream] = []
        try:
            for item in items:
                handles.append(await self._submit_one(**item))
        except BaseException:
            for h in handles:
                h.abort()
                self._forget(h.rid)
            for item in items[len(handles):]:
                self.work.release(item["rid"])
            raise
        return handles

    async def _submit_one(self, *, rid: str, stream: bool = False, **item: Any) -> RequestStream:
        loop = asyncio.get_running_loop()
        if self._wakeups is None or self._wakeups.loop is not loop:
            # One engine's host gate (a ReplicaSet's replicas have one each: none is used).
            gate = getattr(self.engine, "host_gate", None)
            hold_s = float(getattr(getattr(self.engine, "plan", None), "output_hold_s", 0.0) or 0.0)
            self._wakeups = LoopWakeups(loop, gate, hold_s)
        handle = RequestStream(self, rid, self._wakeups)
        self._in_flight[rid] = handle
        try:
            await self.run_blocking(self.engine.submit, rid=rid, stream=stream,
                                    on_output=handle.offer, **item)
        except InvalidRequest as exc:  # the engine's own validation: a client mistake
            self._forget(rid)
            raise RequestError.from_invalid(exc) from None
        except BaseException:
            self._forget(rid)
            raise
        return handle

    def _observe(self, handle: RequestStream, update: Update) -> None:
        if self.metrics is None:
            return
        # The first output with a token (`handle.last` is None: every id in it is new).
        if handle.last is None and update.out.get("output_ids") and not update.finished:
            self.metrics.ttft.observe(time.monotonic() - handle.arrival)
        if update.finished:
            self.metrics.e2e_latency.observe(time.monotonic() - handle.arrival)

    def _forget(self, rid: str) -> None:
        self._in_flight.pop(rid, None)
        self.work.release(rid)

    def abort_soon(self, rid: str, message: str = "aborted by the client") -> None:
        """Abort without waiting (callable from a `finally` of a cancelled task, any thread).
        Coalesced with every other abort asked for before the control thread gets to it."""
        with self._abort_lock:
            self._pending_aborts.setdefault(rid, message)
            if self._abort_flush_scheduled:
                return
            self._abort_flush_scheduled = True
        try:
            self._control_pool.submit(self._flush_aborts)
        except RuntimeError:  # the pool is shut down: the engine aborts everything on shutdown
            pass

    def _flush_aborts(self) -> None:
        with self._abort_lock:
            pending, self._pending_aborts = self._pending_aborts, {}
            self._abort_flush_scheduled = False
        by_message: dict[str, list[str]] = {}
        for rid, message in pending.items():
            by_message.setdefault(message, []).append(rid)
        for message, rids in by_message.items():
            self._abort_logged(rids, message)

    def _abort_logged(self, rids: list[str], message: str = "aborted by the client") -> int:
        try:
            return int(self.engine.abort_many(rids, message))
        except Exception:  # an abort must never take the server down
            logger.exception("engine.abort_many(%d requests) failed", len(rids))
            return 0

    def _matching(self, rid: str) -> list[str]:
        """`rid` itself, or, for a request sent with n > 1, its samples `<rid>-<j>` (the engine's
        naming), or a batch's items `<rid>_<i>` (SGLang's prefix form)."""
        if rid in self._in_flight:
            return [rid]
        return [r for r in self._in_flight
                if r[:len(rid) + 1] in (rid + "-", rid + "_") and r[len(rid) + 1:].isdigit()]

    async def abort(self, rid: str) -> bool:
        """Abort `rid` (and its samples or batch items) in one engine call."""
        rids = self._matching(rid) or [rid]
        return await self.run_control(self._abort_logged, rids) > 0

    async def abort_all(self, message: str = "aborted by the client") -> int:
        """Abort everything in flight in one engine call; answers within one engine step."""
        rids = list(self._in_flight)
        if rids:
            await self.run_control(self._abort_logged, rids, message)
        return len(rids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._control_pool.shutdown(wait=False, cancel_futures=True)
