"""Where the engine thread's time goes, phase by phase, per turn of its loop (issue #19: the
Engine's decode step within 5 % of the model's own step).

A turn schedules and dispatches one step and, with the overlap schedule, resolves the step
dispatched on the turn before; so a turn's phases are those of two steps, and in steady decoding
one turn is one step. The phases, in loop order:

    schedule   scheduler.schedule() (grow, plan, batch build)
    dispatch   dispatch_step: page transfers, host arrays, the step's jitted calls (asynchronous)
    commit     _commit_ahead (overlap): frontiers, placeholders, sealed requests
    wait       the in-flight step's results copied to the host: the device's time, not the host's
    process    tokens, stop checks and StepOutput events of every segment
    emit       the events handed to the output processor's thread
    other      the rest of the turn: inbox, weight swaps

Every phase but `wait` is host work. Without overlap it adds to every step; with overlap it hides
behind the device's step while it is shorter. `Engine.time_host_phases()` turns the clock on (the
bench's loop-overhead row, jengine/bench/e2e.py); off, the loop holds `NO_CLOCK`, whose laps do
nothing.
"""

from __future__ import annotations

import time

import numpy as np

PHASES = ("schedule", "dispatch", "commit", "wait", "process", "emit", "other")


class LoopClock:
    """Seconds per phase of each loop turn that dispatched or resolved a step."""

    def __init__(self) -> None:
        self._turns: list[list[float]] = []
        self._now = 0.0
        self._turn: list[float] | None = None

    def start(self) -> None:
        self._turn = [0.0] * len(PHASES)
        self._now = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap (or `start`) to `phase`; outside a turn (a clock
        installed mid-turn), nothing."""
        if self._turn is None:
            return
        now = time.perf_counter()
        self._turn[PHASES.index(phase)] += now - self._now
        self._now = now

    def end(self, stepped: bool) -> None:
        """Close the turn: the time since the last lap is `other`; a turn that neither dispatched
        nor resolved a step (a command, a swap) is not kept."""
        if self._turn is None:
            return
        self.lap("other")
        if stepped:
            self._turns.append(self._turn)
        self._turn = None

    def summary(self) -> dict:
        """Median ms per phase over the kept turns, `host_ms` (the median of every phase but
        `wait`, summed per turn) and `turns`. Medians: steady decoding, not the prefill turns.
        `total_s`: each phase summed over every kept turn (a whole workload's split, prefill
        turns included: what the server's run is set against the in-process Engine's by)."""
        if not self._turns:
            return {"turns": 0}
        ms = np.asarray(self._turns) * 1e3
        out = {f"{p}_ms": float(np.median(ms[:, i])) for i, p in enumerate(PHASES)}
        host = np.delete(ms, PHASES.index("wait"), axis=1).sum(axis=1)
        out.update(host_ms=float(np.median(host)), turns=len(self._turns),
                   total_s={p: float(ms[:, i].sum() / 1e3) for i, p in enumerate(PHASES)})
        return out


class _NoClock:
    """The clock when nobody asked for one: every call returns at once."""

    def start(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def end(self, stepped: bool) -> None:
        pass


NO_CLOCK = _NoClock()
