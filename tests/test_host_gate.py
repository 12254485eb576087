"""The host gate (jengine/engine/host_gate.py): the output processor holds a step's outputs while
the engine thread works and delivers them while it waits -- never losing or reordering one, and
never holding one longer than --output-hold-ms."""

from __future__ import annotations

import threading
import time

import pytest

from jengine.engine.host_gate import HostGate
from jengine.engine.output_processor import OutputProcessor, RequestState, StepOutput
from jengine.engine.request import SamplingParams


def test_an_open_gate_holds_nobody():
    gate = HostGate()
    gate.hold(30.0)
    assert gate.stats() == {"output_held_s": 0.0, "output_holds": 0, "output_hold_timeouts": 0}


def test_a_closed_gate_holds_until_opened_or_the_maximum():
    gate = HostGate()
    gate.close()
    gate.hold(0.01)  # nobody opens it: gives up after the maximum
    assert gate.holds == 1 and gate.timeouts == 1 and gate.held_s > 0
    gate.hold(0)  # 0: never holds
    assert gate.holds == 1
    threading.Timer(0.05, gate.open).start()
    gate.hold(30.0)  # released by the open, long before its maximum
    assert gate.holds == 2 and gate.timeouts == 1


class _Detok:
    def add(self, token):
        return f"<{token}>"

    def flush(self):
        return ""


def _processor(gate, hold_s):
    delivered = []
    proc = OutputProcessor(lambda rid: None, lambda state: None, gate=gate, hold_s=hold_s)
    state = RequestState(rid="r", prompt_ids=[1, 2], sampling=SamplingParams(max_new_tokens=4),
                         return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
                         return_routed_experts=False, stream=True, detokenizer=_Detok(),
                         on_output=delivered.append)
    proc.add_request(state)
    return proc, delivered


def _wait_for(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_output_processor_delivers_in_the_engines_wait_in_order():
    gate = HostGate()
    gate.close()  # the engine thread is scheduling and dispatching
    proc, delivered = _processor(gate, hold_s=30.0)
    try:
        proc.put([StepOutput("r", new_token_ids=[7])])
        proc.put([StepOutput("r", new_token_ids=[8])])
        time.sleep(0.2)
        assert delivered == []  # held while the gate is closed
        gate.open()  # the engine thread waits for the device
        _wait_for(lambda: len(delivered) >= 2)
        assert [d["output_ids"] for d in delivered] == [[7], [7, 8]]
        assert delivered[-1]["text"] == "<7><8>"
        assert gate.timeouts == 0
    finally:
        gate.open()
        proc.shutdown()


def test_negative_control_no_hold_delivers_through_a_closed_gate():
    gate = HostGate()
    gate.close()
    proc, delivered = _processor(gate, hold_s=0.0)
    try:
        proc.put([StepOutput("r", new_token_ids=[7])])
        _wait_for(lambda: delivered)
        assert [d["output_ids"] for d in delivered] == [[7]] and gate.holds == 0
    finally:
        proc.shutdown()


def test_a_hold_gives_up_after_its_maximum():
    gate = HostGate()
    gate.close()  # and never opened: an engine thread stuck in a long compile
    proc, delivered = _processor(gate, hold_s=0.02)
    try:
        proc.put([StepOutput("r", new_token_ids=[7])])
        _wait_for(lambda: delivered)
        assert [d["output_ids"] for d in delivered] == [[7]]
        assert gate.holds == 1 and gate.timeouts == 1
    finally:
        proc.shutdown()


def test_the_engine_opens_its_gate_whenever_it_waits():
    """With a 1 s maximum, every hold of a real engine's outputs ends because the engine thread
    reached a wait (for the device, or for work), not because the maximum ran out."""
    from jengine.engine.engine import Engine

    engine = Engine("tiny", skip_warmup=True, output_hold_ms=1000.0)
    try:
        engine.time_host_phases()
        streamed = []
        handle = engine.submit(input_ids=[5, 6, 7], sampling_params={
            "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}, stream=True,
            on_output=lambda out: streamed.append(len(out["output_ids"])))
        out = handle.result()
        assert len(out["output_ids"]) == 6 and streamed == [1, 2, 3, 4, 5, 6]
        phases = engine.host_phases()
        assert phases["output_hold_timeouts"] == 0 and engine.host_gate.timeouts == 0
    finally:
        engine.shutdown()


def test_output_hold_ms_is_checked_and_parsed():
    import argparse

    from jengine.config import LaunchConfig, add_launch_arguments, launch_config_from_args
    from jengine.config import validate_choices

    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    cfg = launch_config_from_args(parser.parse_args(["--output-hold-ms", "2.5"]))
    assert cfg.output_hold_ms == 2.5
    for bad in (-1.0, 5000.0, "5", True):
        with pytest.raises(ValueError, match="--output-hold-ms="):
            validate_choices(LaunchConfig(output_hold_ms=bad))


class _Owner:
    def _observe(self, handle, update):
        pass

    def abort_soon(self, rid):
        pass

    def _forget(self, rid):
        pass


def _read_streams(gate, hold_s, n, script, got=None):
    """n streams on one LoopWakeups with `gate`, each offered its final output at once (as one
    step's outputs are); `script(streams, got)` then steers the gate from another thread. Returns
    (rid, time) in the order the readers got their output."""
    import asyncio

    from jengine.server.async_engine import LoopWakeups, RequestStream

    async def run():
        loop = asyncio.get_running_loop()
        wakeups = LoopWakeups(loop, gate, hold_s)
        streams = [RequestStream(_Owner(), f"r{i}", wakeups) for i in range(n)]

        async def read(stream):
            async for update in stream.updates():
                got.append((stream.rid, time.monotonic()))

        _offer_all(streams)
        readers = [asyncio.ensure_future(read(s)) for s in streams]
        driver = threading.Thread(target=script, args=(streams, got))
        driver.start()
        await asyncio.wait_for(asyncio.gather(*readers), 60)
        driver.join()
        return got

    got = [] if got is None else got
    return asyncio.run(run())


def _offer_all(streams):
    for i, s in enumerate(streams):
        s.offer({"text": "", "output_ids": [i], "finished": True, "meta_info": {}})


def test_the_event_loop_wakes_streams_in_the_engines_wait():
    gate = HostGate()
    gate.close()
    opened = []

    def script(streams, got):
        time.sleep(0.3)
        opened.append((len(got), time.monotonic()))
        gate.open()

    got = _read_streams(gate, 30.0, 40, script)  # more streams than one chunk
    assert opened[0][0] == 0  # the engine thread was busy: nobody woken
    assert [rid for rid, _ in got] == [f"r{i}" for i in range(40)]
    assert all(t >= opened[0][1] for _, t in got)


def test_the_event_loop_stops_between_chunks_when_the_engine_gets_busy():
    from jengine.server.async_engine import LoopWakeups

    gate = HostGate()
    first_chunk = []

    class CloseOnFirstRead(list):
        def append(self, item):
            super().append(item)
            if len(self) == 1:
                gate.close()  # the engine thread starts its next step's host work

    def script(streams, got):
        time.sleep(0.3)
        first_chunk.append(len(got))
        gate.open()

    got = _read_streams(gate, 30.0, 4 * LoopWakeups.CHUNK, script, CloseOnFirstRead())
    assert first_chunk == [LoopWakeups.CHUNK]  # the chunk already woken, not one stream more
    assert [rid for rid, _ in got] == [f"r{i}" for i in range(4 * LoopWakeups.CHUNK)]


def test_the_event_loop_gives_up_waiting_after_the_hold():
    gate = HostGate()
    gate.close()  # and never opened

    got = _read_streams(gate, 0.05, 40, lambda streams, got: None)
    assert [rid for rid, _ in got] == [f"r{i}" for i in range(40)]


def test_negative_control_without_a_gate_streams_wake_at_once():
    gate = HostGate()
    gate.close()
    seen = []

    def script(streams, got):
        deadline = time.monotonic() + 30
        while len(got) < 40 and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append(len(got))
        gate.open()

    _read_streams(gate, 0.0, 40, script)  # hold 0: the gate is not consulted
    assert seen == [40]
