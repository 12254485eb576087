"""The engine loop's phase clock (jengine/engine/loop_clock.py): what a turn is charged."""

import time

from jengine.engine.loop_clock import NO_CLOCK, PHASES, LoopClock


def test_laps_charge_their_phase_and_idle_turns_are_dropped():
    clock = LoopClock()
    for stepped in (True, False, True):
        clock.start()
        time.sleep(0.002)
        clock.lap("wait")
        clock.lap("process")
        clock.end(stepped)
    s = clock.summary()
    assert s["turns"] == 2  # the turn that neither dispatched nor resolved a step is not kept
    assert s["wait_ms"] >= 2.0
    # host_ms leaves the device wait out: what remains is far below the 2 ms slept
    assert 0 <= s["host_ms"] < s["wait_ms"]
    assert set(s) == {f"{p}_ms" for p in PHASES} | {"host_ms", "turns", "total_s"}
    assert s["total_s"]["wait"] >= 0.004  # both kept turns slept 2 ms: summed, not a median
    assert s["total_s"]["schedule"] == 0.0


def test_a_clock_installed_mid_turn_waits_for_the_next_turn():
    clock = LoopClock()
    clock.lap("schedule")  # before any start: ignored, no error
    clock.end(True)
    assert clock.summary() == {"turns": 0}
    NO_CLOCK.start(), NO_CLOCK.lap("wait"), NO_CLOCK.end(True)  # the off clock does nothing
