"""When the engine thread's host work is on the step's critical path, so that the threads sharing
its GIL can keep out of its way.

The engine thread spends each loop turn in two kinds of time. Scheduling, dispatching and
processing a step is Python that holds the GIL, and (with the overlap schedule) the device idles
once it runs longer than the step in flight; waiting for that step's results (or for work) holds
no GIL and costs nothing. The output processor's thread (detokenizing, building outputs, running
callbacks) and a server's event loop (encoding and sending the stream events those callbacks
wake) both get their work the moment a turn ends -- just as the next turn's critical host work
starts -- so all three threads used to take turns on the GIL there, and in the server the engine
thread's host phases stretched 2-4x (docs/performance.md, eleventh session).

The gate is open while the engine thread waits (for the device, or for work) and closed while it
works. The output processor holds a step's outputs while the gate is closed, for at most
`--output-hold-ms` (so a long compile or a host-bound engine delays them by that much, no more),
and delivers them in the engine's wait; a server's event loop wakes the streams those outputs
reach in chunks, and defers the rest while the gate is closed, for at most as long
(jengine/server/async_engine.py, `LoopWakeups`). Nothing is reordered or dropped: the hold only
moves when outputs are delivered and read.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger("jengine.engine")


class HostGate:
    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()  # nothing runs yet
        self._lock = threading.Lock()
        self._when_open: list[Callable[[], None]] = []
        self.held_s = 0.0  # the holder's side: seconds spent waiting at the gate
        self.holds = 0  # waits that found it closed
        self.timeouts = 0  # ... and gave up after their maximum

    # The engine thread.
    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()
        with self._lock:  # after the set: a caller that saw it closed has registered by now
            callbacks, self._when_open = self._when_open, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a waiter's hand-off must never take the engine loop down
                logger.exception("host gate callback failed")

    # Any other thread.
    def is_open(self) -> bool:
        return self._open.is_set()

    def call_when_open(self, callback: Callable[[], None]) -> None:
        """Run `callback` once, in the engine thread the next time it opens the gate (at once,
        here, if it is open). It must be quick and must not block: a thread-safe hand-off."""
        with self._lock:
            if not self._open.is_set():
                self._when_open.append(callback)
                return
        callback()

    def hold(self, max_s: float) -> None:
        """Return once the gate is open, or after `max_s` seconds (0: at once)."""
        if max_s <= 0 or self._open.is_set():
            return
        t0 = time.perf_counter()
        opened = self._open.wait(max_s)
        self.held_s += time.perf_counter() - t0
        self.holds += 1
        self.timeouts += not opened

    def stats(self) -> dict:
        return {"output_held_s": self.held_s, "output_holds": self.holds,
                "output_hold_timeouts": self.timeouts}
