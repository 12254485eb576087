"""The trainer's variance on the GPU: triton_norm.mean_fixed_order_torch (the norm kernel's halving
tree and div_rn, launched from torch) on the CPU under Triton's interpreter, against the portable
leaf's mean (an IEEE division by H, pallas_kernels/rmsnorm.py) at widths that are not powers of
two, where a multiply by 1/H is not the division. The GPU's bits are checked on the H200
(scripts/gpu_norm_mean.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences, numpy_halving_tree

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

from pallas_kernels import rmsnorm, triton_norm  # noqa: E402


@pytest.mark.parametrize("width", [96, 1536])
def test_mean_twin_is_the_tree_divided_by_width(width):
    rng = np.random.default_rng(width)
    sq = (rng.standard_normal((2, 64, width)).astype(np.float32) * 2) ** 2
    got = triton_norm.mean_fixed_order_torch(torch.from_numpy(sq)).numpy()
    assert got.shape == (2, 64, 1)
    padded = np.zeros((2, 64, triton_norm.next_pow2(width)), np.float32)
    padded[..., :width] = sq
    tree = numpy_halving_tree(padded)[..., None]
    assert count_bit_differences(got, tree / np.float32(width)) == 0
    assert count_bit_differences(got, rmsnorm.mean_fixed_order_torch(torch.from_numpy(sq))
                                 .numpy()) == 0
    # Control: the multiply by the reciprocal (what XLA made of the division) is another number.
    assert count_bit_differences(got, tree * np.float32(1 / width)) > 0



def test_add_rmsnorm_round_sum_norms_the_residual_it_stores():
    """The kernel's ROUND_SUM (the unfused layer boundary in one launch): the normed rows are
    rmsnorm_kernel's of the new residual it stores, i.e. of the sum rounded to bf16; without it the
    norm reads the f32 sum and rows differ (the control). That the stored residual is torch's /
    XLA's bf16 `residual + x` is the GPU's rounding: the interpreter's bf16 conversion is not
    IEEE round-to-nearest-even, so that half is checked by the JAX leaves' test
    (tests/test_leaves.py) and on the H200 by the goldens."""
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(16, 96, generator=gen).mul(3).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(96, generator=gen).to(torch.bfloat16)
    normed, new_res = triton_norm.add_rmsnorm_triton_torch(x, r, w, eps=1e-5, round_sum=True)
    want = triton_norm.rmsnorm_triton_torch(new_res, w, eps=1e-5)
    assert count_bit_differences(normed.float().numpy(), want.float().numpy()) == 0
    f32_sum, same_res = triton_norm.add_rmsnorm_triton_torch(x, r, w, eps=1e-5)
    assert count_bit_differences(same_res.float().numpy(), new_res.float().numpy()) == 0
    assert count_bit_differences(f32_sum.float().numpy(), want.float().numpy()) > 0


@pytest.mark.parametrize("width", [96, 128])
def test_several_rows_per_program_give_the_one_row_kernels_bits(width):
    """The unfused boundary on ROWS rows per program (add_rmsnorm_rows_kernel, planned for prefill
    M by triton_norm.ROWS_PLAN) against one row per program: the same size-2 sums, so the same
    bits, at row counts that do and do not fill the last program. The control: the f32 sum's norm
    (the fused boundary) differs from it, so the comparison can fail."""
    gen = torch.Generator().manual_seed(width)
    for m in (1, 5, 9):
        x, r = (torch.randn(m, width, generator=gen).mul(3).to(torch.bfloat16) for _ in range(2))
        w = torch.randn(width, generator=gen).to(torch.bfloat16)
        one = triton_norm.add_rmsnorm_triton_torch(x, r, w, eps=1e-5, round_sum=True, plan=())
        for rows, warps in ((1, 1), (2, 4), (4, 4)):
            assert triton_norm.rows_plan(m, True, ((1, rows, warps),)) == (rows, warps)
            got = triton_norm.add_rmsnorm_triton_torch(x, r, w, eps=1e-5, round_sum=True,
                                                       plan=((1, rows, warps),))
            for a, b in zip(got, one):
                assert count_bit_differences(a.float().numpy(), b.float().numpy()) == 0, (m, rows)
        f32_sum, _ = triton_norm.add_rmsnorm_triton_torch(x, r, w, eps=1e-5)
        assert count_bit_differences(f32_sum.float().numpy(), one[0].float().numpy()) > 0, m
    # Only the rounded sum may take the rows launch: the fused boundary's never does. The shipped
    # plan: one row per program on one warp at every M, the H100's measurement
    # (scripts/gpu_norm_rows.py, twenty-sixth session).
    assert triton_norm.rows_plan(4096, False, ((1, 4, 8),)) is None
    assert triton_norm.rows_plan(1, True) == (1, 1) == triton_norm.rows_plan(4096, True)


def test_a_rows_launch_takes_more_warps_only_where_one_would_spill():
    """One warp holds a hidden-4096 row (Llama-3-8B) without spilling; wider rows (Qwen 14B's
    5120, Llama-70B's 8192: blocks of 8192) take a warp per 4096 elements (sm_90 ptxas: 6.8 KB
    of spill a thread at 8192 on one warp, none on two). A plan's larger count stands."""
    block = lambda h: triton_norm._launch_params(h)[0]["BLOCK"]  # noqa: E731
    assert [triton_norm.rows_warps(block(h), 1) for h in (96, 4096, 5120, 8192, 16384)] == \
        [1, 1, 2, 2, 4]
    assert triton_norm.rows_warps(block(8192), 4) == 4
