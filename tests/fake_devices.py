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


def run_probe(script: str, devices: int = 8) -> dict:
    """tests/<script> under --xla_force_host_platform_device_count=devices; its last stdout line
    (JSON) parsed."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, str(ROOT / "tests" / script)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
