"""`jengine ops-report`: measured XLA-vs-torch differences, and trainer mode closing each gap."""

from __future__ import annotations

import pytest

from interop.ops_report import build_rows, format_table


@pytest.fixture(scope="module")
def rows():
    return {r.op: r for r in build_rows("cpu", seed=0, elementwise_size=1 << 16)}


def test_report_covers_the_ops(rows):
    wanted = {"gemm (linear leaf)", "rmsnorm", "silu", "exp", "log", "rsqrt", "sqrt", "tanh", "sigmoid",
              "cos", "sin", "pow(x, 0.37)", "log_softmax (blockwise)", "attention (causal)"}
    assert wanted <= set(rows)
    table = format_table(list(rows.values()))
    assert table.splitlines()[0].startswith("op") and "attention (causal)" in table


def test_trainer_mode_closes_every_routed_gap(rows):
    routed = {op: r.trainer_mode_differing for op, r in rows.items() if r.trainer_mode_differing is not None}
    assert routed and routed == {op: 0 for op in routed}, routed


def test_report_sees_real_differences(rows):
    """Negative control: stock torch differs from XLA on the CPU for these (platform-facts.md), so
    the report's counter is live, and the routed ops above had something to fix."""
    for op in ("exp", "rsqrt", "tanh", "attention (causal)"):
        assert rows[op].differing > 0 and rows[op].max_ulp > 0, rows[op]
    assert rows["residual add"].differing == 0  # glue is correctly rounded in both
