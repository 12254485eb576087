"""scripts/gpu_bisect_mla.py, the trainer-vs-engine state bisect of the MLA + MoE families.

The CI part is the verdict logic on hand-made states (the first differing row, the control's
verdict refusing a wrong row and an earlier difference). The whole script on LongCat-Flash's smoke
widths (every state equal on the CPU, and the --perturb control naming its state and row) takes
about 25 s and is slow-only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_bisect_mla as bisect  # noqa: E402


def _states(*names):
    return {name: np.arange(12, dtype=np.float32).reshape(4, 3) + i for i, name in enumerate(names)}


def test_compare_names_the_first_differing_row_by_bits():
    trainer = _states("a", "b", "c")
    engine = {k: v.copy() for k, v in trainer.items()}
    engine["b"][2, 1] = np.nextafter(engine["b"][2, 1], np.float32(np.inf))
    engine["b"][3, 0] = np.nextafter(engine["b"][3, 0], np.float32(np.inf))
    trainer["c"][0, 0], engine["c"][0, 0] = 0.0, -0.0  # equal values, other bits: a difference
    del engine["a"]
    rows = bisect.compare(trainer, engine)
    assert rows[0] == dict(state="a", note="no engine state")
    assert rows[1] == dict(state="b", rows_differ=2, first_row=2, cols_differ_in_first=1)
    assert rows[2] == dict(state="c", rows_differ=1, first_row=0, cols_differ_in_first=1)
    assert bisect.summarize(rows, 4)["first_differing"]["state"] == "b"
    assert not bisect.summarize(rows, 4)["all_equal"]


def test_control_verdict_accepts_only_the_perturbed_state_and_row_first():
    equal = dict(rows_differ=0, first_row=-1, cols_differ_in_first=0)
    hit = dict(state="n", rows_differ=3, first_row=5, cols_differ_in_first=1)
    assert bisect.control_verdict([dict(state="m", **equal), hit], "n", 5) is None
    assert "first differing row 5" in bisect.control_verdict([hit], "n", 4)
    earlier = dict(state="m", rows_differ=1, first_row=0, cols_differ_in_first=1)
    assert "before the perturbed" in bisect.control_verdict([earlier, hit], "n", 5)
    missing = dict(state="m", note="no engine state")
    assert "before the perturbed" in bisect.control_verdict([missing, hit], "n", 5)
    assert "not among" in bisect.control_verdict([dict(state="m", **equal)], "n", 5)


@pytest.mark.slow  # ~25 s; its CI siblings are the two tests above
def test_longcat_smoke_all_equal_and_the_control_names_its_state_and_row(tmp_path):
    state, row = "layers.1.input_layernorm.1", 40
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_bisect_mla.py", "--case", "longcat", "--smoke", "--seq", "0",
         "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
         "--perturb", f"{state}:{row}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "bisect_longcat.json").read_text())
    names = [r["state"] for r in summary["states"]]
    for wanted in ("layers.0.self_attn.1.kv_a_layernorm", "layers.1.mlp.gate.ids",
                   "layers.1.mlp.experts", "layers.1.mlps.1.input", "layers.0.self_attn.0.o_proj"):
        assert wanted in names
    assert summary["all_equal"], summary["first_differing"]
    control = summary["control"]
    assert control["named"], control
    assert control["first_differing"]["state"] == state
    assert control["first_differing"]["first_row"] == row
