"""examples/rl_loop.py end to end on the CPU: a real rl-bitwise server samples, an HF trainer under
trainer mode scores and steps, the weights go back over /update_weights_from_tensor -- and the
train/rollout logprob gap is exactly 0.0 with every bit equal at every step, while stock torch's
gap (the negative control printed beside it) is not."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rl_loop_gap_is_zero_at_every_step_and_stock_torch_differs():
    run = subprocess.run([sys.executable, "examples/rl_loop.py", "--steps", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if re.match(r"^\s+\d+\s", line)]
    assert [r[0] for r in rows] == ["0", "1"]
    assert [r[1] for r in rows] == ["default", "step-1"]  # the second rollout ran on the update
    for r in rows:
        gap, bits_differ, stock_gap, changed = float(r[3]), int(r[4]), float(r[5]), int(r[6])
        assert (gap, bits_differ) == (0.0, 0), r
        assert stock_gap > 0.0 and changed > 0, r
    assert run.stdout.rstrip().splitlines()[-1].startswith("PASS")
