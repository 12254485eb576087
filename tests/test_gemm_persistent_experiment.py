"""scripts/gpu_gemm_persistent.py's logic on the CPU, under Triton's interpreter: the persistent
kernel it times on the H200 (an experiment, wired into no leaf) walks every output tile once and
closes its K chunks in the contract's order, so its f32 outputs equal the engine's GEMM launch on
the same K chunks; at twice the chunks they differ (the script's control). The engine's flat_k
launches it also times equal it too. The GPU's bits and
timings are the script's to measure on the device, not this test's."""

from __future__ import annotations

import pytest

from tests import triton_interpreter


pytestmark = pytest.mark.skipif(not triton_interpreter.AVAILABLE,
                                reason="triton or torch is not installed")


def test_persistent_kernel_keeps_the_engines_k_chunks(tmp_path):
    rows = triton_interpreter.run_smoke("gpu_gemm_persistent.py", tmp_path, "gemm_persistent")
    assert [r["m"] for r in rows] == [3, 40]  # 40 rows: more tiles than programs, so some loop
    for r in rows:
        assert [v["differ"] for v in r["persistent"].values()] == [0], r
        assert [v["differ"] for v in r["flat"].values()] == [0, 0], r
        assert r["control_differ"] > 0, r
