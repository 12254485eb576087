"""Run a probe script in a subprocess on 8 fake CPU devices (XLA reads the device count once per
process, so a multi-device measurement cannot run in the test process itself)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fake_device_env(devices: int = 8) -> dict[str, str]:
    """This process's environment with `devices` fake CPU devices (for a child process)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_probe(script: str, *args: str, devices: int = 8, timeout: float = 600) -> dict:
    """tests/<script> [args] under --xla_force_host_platform_device_count=devices; its last stdout
    line (JSON) parsed."""
    done = subprocess.run([sys.executable, str(ROOT / "tests" / script), *args],
                          env=fake_device_env(devices), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
