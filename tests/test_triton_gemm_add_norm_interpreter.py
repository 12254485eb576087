"""The projection + layer boundary launch (pallas_kernels/triton_gemm_add_norm.py, an experiment
not yet a leaf) on the CPU, under Triton's interpreter: its (normed, new residual) are the bits of
the two launches it replaces -- the fused-reduce GEMM, then add_rmsnorm with round_sum -- for one
and several row blocks, a partial last block, masked columns and a bias; it leaves its counters
zero; and the check fails when a row block is normed before its last tile is written (the
control). The interpreter checks the logic; the H200's bits and time are
scripts/gpu_gemm_add_norm.py's to measure."""

from __future__ import annotations

import dataclasses

import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

from pallas_kernels import triton_gemm, triton_gemm_add_norm, triton_norm  # noqa: E402

TILE = triton_gemm.GemmTile(16, 32, 32, num_warps=4, num_stages=2, k_split=4, fused_reduce=True)
K, N, EPS = 256, 80, 1e-5  # N not a multiple of BN (masked columns) nor a power of two


@pytest.fixture(scope="module")
def operands():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, K, generator=gen).to(torch.bfloat16)
    w = (torch.randn(K, N, generator=gen) / 16).to(torch.bfloat16)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16)
    residual = torch.randn(40, N, generator=gen).mul(3).to(torch.bfloat16)
    norm_weight = (1 + torch.randn(N, generator=gen) / 10).to(torch.bfloat16)
    return x, w, bias, residual, norm_weight


def _two_launches(x, w, bias, residual, norm_weight):
    h = triton_gemm.gemm_triton_torch(x, w, bias, out_dtype=torch.bfloat16, tile=TILE,
                                      schedule="split")
    return triton_norm.add_rmsnorm_triton_torch(h, residual, norm_weight, eps=EPS,
                                                round_sum=True)


def _differ(a, b) -> int:
    return count_bit_differences(a.float().numpy(), b.float().numpy())


@pytest.mark.parametrize("m", [1, 5, 16, 40])  # 40: three row blocks of 16, the last partial
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_launch_has_the_two_launches_bits(operands, m, with_bias):
    x, w, bias, residual, norm_weight = operands
    bias = bias if with_bias else None
    want = _two_launches(x[:m], w, bias, residual[:m], norm_weight)
    got = triton_gemm_add_norm.gemm_add_rmsnorm_triton_torch(
        x[:m], w, bias, residual[:m], norm_weight, eps=EPS, tile=TILE)
    assert [_differ(g, t) for g, t in zip(got, want)] == [0, 0]


def _launch(x, w, residual, norm_weight, sems):
    """The kernel on given counters, h starting as zeros: (normed, counters after)."""
    m, n = x.shape[0], w.shape[1]
    _, _, tile, grid, consts = triton_gemm_add_norm._plan(x, w, None, residual, norm_weight, True,
                                                          TILE)
    size = triton_gemm_add_norm._counters(m, n, tile).size
    sems = torch.full((size,), sems, dtype=torch.int32) if isinstance(sems, int) else sems
    parts = torch.zeros((tile.k_split, m, n))
    h, normed, new_res = (torch.zeros((m, n), dtype=torch.bfloat16) for _ in range(3))
    triton_gemm.torch_launch(triton_gemm_add_norm.kernels().gemm_add_rmsnorm_kernel,
                             (x, w, w, residual, norm_weight, EPS, m, sems),
                             (parts, h, normed, new_res, sems), grid, num_warps=4, num_stages=2,
                             **consts)
    return normed, sems


def test_it_leaves_its_counters_zero(operands):
    """Tile and row-block counters both end at zero, so the step's one counter buffer can go on
    to the next counting launch (_triton_launch.Counters): a second launch on them, not re-zeroed,
    gives the same bits."""
    x, w, _, residual, norm_weight = operands
    want = _two_launches(x, w, None, residual, norm_weight)[0]
    normed, sems = _launch(x, w, residual, norm_weight, 0)
    assert _differ(normed, want) == 0 and int(sems.abs().sum()) == 0
    again, sems = _launch(x, w, residual, norm_weight, sems)
    assert _differ(again, want) == 0 and int(sems.abs().sum()) == 0


def test_negative_control_a_block_normed_a_tile_early_differs(operands):
    """The checks above can fail: with every counter starting at 1, a tile is closed by its
    next-to-last chunk program and a row block is normed when its next-to-last tile closes -- with
    a tile of h still zeros -- and the normed rows differ."""
    x, w, _, residual, norm_weight = operands
    normed, sems = _launch(x, w, residual, norm_weight, 1)
    assert _differ(normed, _two_launches(x, w, None, residual, norm_weight)[0]) > 0
    assert (sems == 1).all()


def test_bad_input_names_what_is_wrong(operands):
    x, w, bias, residual, norm_weight = operands
    call = triton_gemm_add_norm.gemm_add_rmsnorm_triton_torch
    with pytest.raises(ValueError, match=r"residual.shape=\(40, 79\) must be \(40, 80\)"):
        call(x, w, None, residual[:, :79], norm_weight, eps=EPS, tile=TILE)
    with pytest.raises(ValueError, match=r"norm_weight.shape=\(79,\) must be \(80,\)"):
        call(x, w, None, residual, norm_weight[:79], eps=EPS, tile=TILE)
    with pytest.raises(ValueError, match="round_sum=False is not supported"):
        call(x, w, None, residual, norm_weight, eps=EPS, round_sum=False, tile=TILE)
    with pytest.raises(ValueError, match="has no fused split-K reduce"):
        call(x, w, None, residual, norm_weight, eps=EPS,
             tile=dataclasses.replace(TILE, fused_reduce=False))


def test_the_h200_script_checks_what_it_says(tmp_path):
    """scripts/gpu_gemm_add_norm.py --smoke: the script's bits part under the interpreter -- 0
    bits differ from the two launches, and its control (the f32 sum) does differ."""
    rows = triton_interpreter.run_smoke("gpu_gemm_add_norm.py", tmp_path, "gemm_add_norm")
    assert [r["m"] for r in rows] == [1, 20]
    for r in rows:
        assert (r["normed_differ"], r["residual_differ"]) == (0, 0), r
        assert (r["timed_one_differ"], r["timed_two_differ"]) == (0, 0), r  # what it would time
        assert r["control_differ"] > 0, r
