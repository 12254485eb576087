"""The Triton rope_write leaf's logic, on the CPU, under Triton's interpreter.

What the interpreter can show (numpy f32 arithmetic): q and k get HF's rotation as three rounded
f32 operations per element (against numpy doing exactly those), k and v land at each token's
(page, slot), a padding row's out-of-bounds page writes nothing, and no other slot changes. bf16
bits need the GPU's roundings (the interpreter's bf16 conversion is not round-to-nearest-even):
the H200 goldens run this leaf in every decode and prefill step (docs/gpu-validation.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

from pallas_kernels import triton_rope_write as trw  # noqa: E402

T, HQ, HKV, D, PAGES, PAGE_SIZE = 5, 4, 2, 16, 6, 4


def _rotate(x, c, s, negate=True):
    """numpy's f32: x * cos, rotate_half(x) * sin, their sum -- each op rounded, no FMA."""
    half = D // 2
    rot = np.concatenate([(-1 if negate else 1) * x[..., half:], x[..., :half]], axis=-1)
    return (x * c[:, None, :]).astype(np.float32) + (rot * s[:, None, :]).astype(np.float32)


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((T, HKV, D)).astype(np.float32)
    v = rng.standard_normal((T, HKV, D)).astype(np.float32)
    angle = rng.uniform(0, 6.3, (T, D)).astype(np.float32)
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    page = np.array([1, 3, PAGES, 2, 1], np.int32)  # row 2 is padding: out of bounds, dropped
    slot = np.array([0, 2, 1, 3, 1], np.int32)
    pool = rng.standard_normal((2, PAGES, PAGE_SIZE, HKV, D)).astype(np.float32)
    return q, k, v, cos, sin, page, slot, pool


def _run(case, merged=False):
    q, k, v, cos, sin, page, slot, pool = case
    kp, vp = (torch.from_numpy(pool[i].copy()) for i in range(2))
    out, (kp, vp) = trw.rope_write_triton_torch(
        *(torch.from_numpy(a) for a in (q, k, v, cos, sin)), (kp, vp),
        torch.from_numpy(page), torch.from_numpy(slot), merged=merged)
    return out.numpy(), kp.numpy(), vp.numpy()


def test_rotation_and_page_writes(case):
    q, k, v, cos, sin, page, slot, pool = case
    out, kp, vp = _run(case)
    assert count_bit_differences(out, _rotate(q, cos, sin)) == 0
    want_k, want_v = pool[0].copy(), pool[1].copy()
    rk = _rotate(k, cos, sin)
    for t in range(T):
        if page[t] < PAGES:
            want_k[page[t], slot[t]] = rk[t]
            want_v[page[t], slot[t]] = v[t]
    assert count_bit_differences(kp, want_k) == 0, "k pages: a wrong slot, or the padding row wrote"
    assert count_bit_differences(vp, want_v) == 0


def test_negative_control_an_unnegated_half_differs(case):
    """The comparison above can fail: rotate_half without its negation is another number."""
    q, k, v, cos, sin, page, slot, pool = case
    out, _, _ = _run(case)
    assert count_bit_differences(out, _rotate(q, cos, sin, negate=False)) > 0


def test_head_dim_that_is_not_a_power_of_two_is_refused():
    q = torch.zeros(1, 2, 24)
    k = v = torch.zeros(1, 1, 24)
    cs = torch.zeros(1, 24)
    pages = torch.zeros(2, 4, 1, 24)
    with pytest.raises(ValueError, match="head_dim=24"):
        trw.rope_write_triton_torch(q, k, v, cs, cs, (pages, pages.clone()), torch.zeros(1),
                                    torch.zeros(1))


def test_the_merged_read_gives_the_three_buffers_results(case):
    """triton_fused_qkv (auto) reads q, k and v from their concatenation: every output the same
    bits as the launch on three buffers. Control: k and v swapped in the concatenation land other
    values in the pages, so the offsets are checked."""
    separate = _run(case)
    for got, want in zip(_run(case, merged=True), separate):
        assert count_bit_differences(got, want) == 0
    q, k, v, *rest = case
    swapped = _run((q, v, k, *rest), merged=True)
    assert count_bit_differences(swapped[1], separate[1]) > 0


@pytest.fixture
def registered(monkeypatch):
    yield from triton_interpreter.registered_as_on_a_gpu(
        monkeypatch, trw, [("attention", "rope_write", "triton_fused"),
                           ("attention", "rope_write", "triton_fused_qkv")])


def test_auto_plans_the_merged_read_and_rl_bitwise_never_does(registered):
    from pallas_kernels.registry import REGISTRY

    def plan(features):
        return REGISTRY.plan("attention", "rope_write", formats={"bf16"}, hardware="gpu",
                             geometry={"head_dim": 128}, features=features).leaf.impl

    assert plan(frozenset()) == "triton_fused_qkv"  # --numerics auto
    assert plan(frozenset({"batch_invariant"})) == "triton_fused"  # rl-bitwise


def test_rotate_halfs_negation_keeps_the_sign_of_zero(case):
    """A row whose first half is -0.0 and second half +0.0: rotate_half negates +0.0 to -0.0 (torch
    and XLA do), so x * cos + rotate_half(x) * sin is -0.0 there. Triton's unary minus is 0 - x,
    which gives +0.0: the control, the same sum with 0 - x, differs."""
    q, k, v, cos, sin, page, slot, pool = case
    q = q.copy()
    q[0, 0, D // 2:] = 0.0
    q[0, 0, :D // 2] = -0.0
    cos, sin = np.full_like(cos, 0.5), np.full_like(sin, 0.25)
    out, _, _ = _run((q, k, v, cos, sin, page, slot, pool))
    want = _rotate(q, cos, sin)
    assert np.signbit(want[0, 0, :D // 2]).all()
    assert count_bit_differences(out, want) == 0
    half = D // 2
    sub_zero = np.concatenate([np.float32(0.0) - q[..., half:], q[..., :half]], axis=-1)
    control = (q * cos[:, None, :]).astype(np.float32) + (sub_zero * sin[:, None, :])
    assert count_bit_differences(control, want) > 0
