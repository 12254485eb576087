"""Run a probe script in a subprocess on 8 fake CPU devices (XLA reads the device count once per
process, so a multi-device measurement cannot run in the test process itself).

A probe is mostly one core compiling while the test process, on a 2-core CI machine, leaves the
other core idle much of the time. So a fixture made by `probe_fixture` is known to the session:
once collection is done, tests/conftest.py hands the selected tests' probes to `ProbeQueue`, which
runs them one after another in the background, in test order; the fixture then takes its probe's
result (started early, still running, or not yet started: then it starts it itself). What a probe
measures and what its test asserts are the same as when run in the foreground.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def fake_device_env(devices: int = 8) -> dict[str, str]:
    """This process's environment with `devices` fake CPU devices (for a child process)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


class Probe:
    """tests/<script> [args] started now under `devices` fake CPU devices; `result()` waits for its
    last stdout line (JSON)."""

    def __init__(self, script: str, args: tuple[str, ...], devices: int = 8, timeout: float = 600):
        self.name = " ".join((script, *args))
        # files, not pipes: a probe nobody reads yet must not block on a full pipe
        self._stdout, self._stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self._deadline = time.monotonic() + timeout
        self._proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / script), *args],
                                      env=fake_device_env(devices), cwd=ROOT, text=True,
                                      stdout=self._stdout, stderr=self._stderr)

    def wait(self) -> int:
        try:
            return self._proc.wait(timeout=max(self._deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def result(self) -> dict:
        returncode = self.wait()
        self._stdout.seek(0)
        self._stderr.seek(0)
        assert returncode == 0, f"{self.name}: exit {returncode}\n" + self._stderr.read()[-4000:]
        return json.loads(self._stdout.read().strip().splitlines()[-1])


ProbeKey = tuple  # (script, args, devices)


class ProbeQueue:
    """Runs the given probes one at a time in a background thread, in order; `take` hands a
    fixture its probe, started now if the queue has not reached it yet."""

    def __init__(self, keys: list[ProbeKey]):
        self._pending = list(dict.fromkeys(keys))
        self._started: dict[ProbeKey, Probe] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="probe-queue", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._pending:
                    return
                key = self._pending.pop(0)
                probe = self._started[key] = Probe(key[0], key[1], key[2])
            try:
                probe.wait()
            except subprocess.TimeoutExpired:
                pass  # its fixture's result() reports it

    def take(self, key: ProbeKey) -> Probe:
        with self._lock:
            if key in self._pending:
                self._pending.remove(key)
            return self._started.pop(key, None) or Probe(key[0], key[1], key[2])

    def close(self) -> None:
        """Stop the queue and kill the probes nobody took (a session that ended early)."""
        with self._lock:
            self._closed = True
            left, self._started = list(self._started.values()), {}
        for probe in left:
            probe.stop()


QUEUE: ProbeQueue | None = None  # set by tests/conftest.py for the session


def run_probe(script: str, *args: str, devices: int = 8, timeout: float = 600) -> dict:
    """tests/<script> [args] under --xla_force_host_platform_device_count=devices; its last stdout
    line (JSON) parsed."""
    key = (script, args, devices)
    probe = QUEUE.take(key) if QUEUE is not None else Probe(script, args, devices, timeout)
    return probe.result()


def probe_fixture(name: str, script: str, *args: str, devices: int = 8):
    """A module-scoped fixture `name` whose value is the probe's JSON; the session starts the probe
    in the background when a selected test uses the fixture (`ProbeQueue`)."""
    def fixture():
        return run_probe(script, *args, devices=devices)

    fixture.probe = (script, args, devices)
    return pytest.fixture(scope="module", name=name)(fixture)


def selected_probes(items) -> list[ProbeKey]:
    """The probes of `probe_fixture` fixtures the given tests use, directly or through other
    fixtures, in test order."""
    keys = []
    for item in items:
        for defs in getattr(item, "_fixtureinfo").name2fixturedefs.values():
            keys += [d.func.probe for d in defs if hasattr(d.func, "probe")]
    return list(dict.fromkeys(keys))
