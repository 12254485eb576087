"""The dense layer's fused rope_write + attention path (planned by default;
JENGINE_ATTENTION_ROPE=off calls the two leaves; pallas_kernels/rope_attention.py) on the CPU: the
portable leaf of the family, which the rl-bitwise plan takes there, and the two leaves must give
the goldens' bits (tests/goldens/cpu.json, tiny section: page size 4, so steps cross pages); a
control shows the path is taken and a wrong leaf on it is caught. The Triton leaves' own checks:
tests/test_triton_rope_attention.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import pallas_kernels  # noqa: F401  (registers the leaves)
from pallas_kernels import rope_attention
from pallas_kernels.attention import paged_fixed_order
from pallas_kernels.gemm_epilogues import composes
from pallas_kernels.registry import REGISTRY, Priority
from pallas_kernels.rope_write import rope_write

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import goldens  # noqa: E402

GOLDEN = json.loads((ROOT / "tests" / "goldens" / "cpu.json").read_text())


@pytest.mark.parametrize("value", ["fused", "off"])
def test_the_fused_path_and_the_two_leaves_keep_every_golden_bit(value, monkeypatch):
    monkeypatch.setenv(rope_attention.ENV, value)
    got = goldens.compute(["tiny"], trainer=False, device="cpu")["tiny"]
    assert goldens.differences(GOLDEN["tiny"], got, "tiny") == []


def test_control_the_fused_path_is_taken_and_a_wrong_leaf_on_it_is_caught(monkeypatch):
    """A stand-in declaring the portable leaf's composition, ranked above it, that counts its
    calls and attends with twice the scale: it must have been called, and the tiny section's
    bits must move (so the equality above is the fused leaf's, and would catch a wrong one)."""
    calls = []

    def wrong(q, k, v, cos, sin, kv, page, slot, block_tables, token_req, positions, *, scale):
        calls.append(q.shape)
        q, kv = rope_write(q, k, v, cos, sin, kv, page, slot)
        return paged_fixed_order(q, kv, block_tables, token_req, positions, scale=2 * scale), kv

    REGISTRY.register("attention", "rope_paged", "standin_wrong", formats={"bf16", "f32"},
                      hardware={"any"}, priority=Priority.VENDOR, features={
                          "batch_invariant", composes(attention="fixed_order",
                                                      rope_write="xla")})(wrong)
    try:
        monkeypatch.setenv(rope_attention.ENV, "fused")
        got = goldens.compute(["tiny"], trainer=False, device="cpu")["tiny"]
    finally:
        REGISTRY.unregister("attention", "rope_paged", "standin_wrong")
    assert calls, "the model never called rope_paged"
    assert goldens.differences(GOLDEN["tiny"], got, "tiny") != []
