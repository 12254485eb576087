"""scripts/gpu_silu_down.py's logic on the CPU, under Triton's interpreter: down_proj with SwiGLU's
activation made in the loads of its A (silu_gemm_rows_kernel, an experiment wired into no leaf)
gives the bits of the SiLU launch and the GEMM launch it would replace, with only the real rows in
A and with every MMA row; the activation rounded once (the script's control) differs. Whether the
GPU's MMA with A in registers keeps those bits, and the timings, are the device's to measure."""

from __future__ import annotations

import pytest

from tests import triton_interpreter


pytestmark = pytest.mark.skipif(not triton_interpreter.AVAILABLE,
                                reason="triton or torch is not installed")


def test_the_activation_in_downs_a_loads_keeps_the_two_launches_bits(tmp_path):
    rows = triton_interpreter.run_smoke("gpu_silu_down.py", tmp_path, "silu_down")
    assert [r["m"] for r in rows] == [1, 3, 16]
    for r in rows:
        forms = r["forms"]
        # the real rows (RB 1 / 4) and all 16 MMA rows; 16 rows: RB 16 is both
        assert len(forms) == (2 if r["m"] == 16 else 3), r
        assert all(f["differ"] == 0 for f in forms.values()), r
        assert r["control_differ"] > 0, r
