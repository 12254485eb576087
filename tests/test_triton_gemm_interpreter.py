"""The split-K GEMM's two schedules, on the CPU, under Triton's interpreter.

The interpreter runs the kernel source with numpy, so this checks the logic -- chunk bounds, masks,
the partial buffer, the reduce kernel's order and bias -- not the GPU's bits (those:
scripts/gpu_validate.py on the H200, where rows at M = 1..64 run the split schedule and M = 512
the serial one). Skipped where triton or torch is missing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

from pallas_kernels import triton_gemm, triton_gemm_tiles  # noqa: E402

TILE = triton_gemm.GemmTile(32, 32, 32, num_warps=4, num_stages=2, k_split=4)
K, N = 256, 80  # N not a multiple of BN: masked columns


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((70, K)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((K, N)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
    return x, w, b


def _gemm(x, w, b, schedule, tile=TILE):
    return triton_gemm.gemm_triton_torch(x, w, b, out_dtype="f32", tile=tile,
                                         schedule=schedule).numpy()


def test_schedules_agree_bitwise_and_rows_do_not_depend_on_m(operands):
    x, w, b = operands
    serial = _gemm(x, w, b, "serial")
    assert count_bit_differences(serial, _gemm(x, w, b, "split")) == 0
    for m in (1, 3, 33):
        assert count_bit_differences(serial[:m], _gemm(x[:m], w, b, None)) == 0  # split (few tiles)
    # f32 over K = 256 in 4 chunks: 1e-4 absolute on values of size ~16 (a few ulp per add).
    np.testing.assert_allclose(serial, x.double().numpy() @ w.double().numpy() + b.numpy(),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("shape", [(16, 32, 32, 4, 2), (64, 16, 16, 4, 3), (32, 64, 64, 8, 4)])
def test_another_launch_shape_on_the_same_k_chunks_keeps_every_bit(operands, shape):
    """What lets a table's by_m rules give decode steps other tiles: BM, BN, BK, warps and stages
    move no bit, only k_split does (the control below). The interpreter's dot steps K one element
    at a time, the H200's MMA 16 at a time; the GPU's bits: scripts/gpu_gemm_decode_tiles.py."""
    x, w, b = operands
    bm, bn, bk, warps, stages = shape
    other = triton_gemm.GemmTile(bm, bn, bk, num_warps=warps, num_stages=stages, k_split=4)
    ref = _gemm(x, w, b, "serial")
    for schedule in ("serial", "split"):
        for m in (1, 3, 70):
            assert count_bit_differences(ref[:m], _gemm(x[:m], w, b, schedule, other)) == 0, (
                schedule, m)


def _assert_split_bits(operands, members, tile, schedule, group_rows):
    """`tile` on `schedule` gives the split schedule's bits on TILE's K chunks: alone with and
    without bias at M = 1, 33 and 70, and as every member of a grouped launch of group_rows."""
    x, w, b = operands
    for bias in (None, b):
        ref = _gemm(x, w, bias, "split")
        for m in (1, 33, 70):
            assert count_bit_differences(ref[:m], _gemm(x[:m], w, bias, schedule, tile)) == 0, m
    ws, bs = members
    for biases in (None, bs):
        outs = triton_gemm.gemm_group_triton_torch(x[:group_rows], ws, biases, out_dtype="f32",
                                                   tile=tile, schedule=schedule)
        for i, wi in enumerate(ws):
            alone = _gemm(x[:group_rows], wi, None if biases is None else biases[i], "split")
            assert count_bit_differences(alone, outs[i].numpy()) == 0, i


def test_the_fused_reduce_keeps_every_bit(operands, members):
    """A tile's fused_reduce: the last of a tile's chunk programs adds the chunks (a counter per
    output tile) instead of gemm_reduce_kernel -- the same additions in the same order."""

    _assert_split_bits(operands, members, dataclasses.replace(TILE, fused_reduce=True), "split",
                       33)


def test_the_flat_k_loop_keeps_every_bit(operands, members):
    """A tile's flat_k: the serial schedule's chunks in one K loop, a chunk closed into the running
    sum when it ends -- the serial form's additions in the same order. Checked against the split
    schedule (the serial one agrees, above), with and without bias, masked columns (N = 80), one
    and three row tiles, and in the grouped launch; the split schedule and a tile without chunks
    keep their own loops."""

    x = operands[0]
    flat = dataclasses.replace(TILE, flat_k=True)
    _assert_split_bits(operands, members, flat, "serial", 70)
    (_, consts), _ = triton_gemm._launches(70, K, N, x.dtype, None, flat, "serial")
    assert consts["FLAT_K"] and not consts["PARTIAL"]
    (_, consts), _ = triton_gemm._launches(70, K, N, x.dtype, None, flat, "split")
    assert not consts["FLAT_K"] and consts["PARTIAL"]
    one_chunk = triton_gemm.GemmTile(32, 32, 32, k_split=1, flat_k=True)
    (_, consts), _ = triton_gemm._launches(70, K, N, x.dtype, None, one_chunk, "serial")
    assert not consts["FLAT_K"]  # no chunks to close: the plain loop


def test_the_flat_k_loop_negative_control_chunks_closed_twice_as_often_differ(operands):
    """The check above can fail: the flat loop at twice the chunks (k_split 8) differs from the
    split schedule at k_split 4 -- so it does compare where the chunks close."""
    x, w, b = operands
    eight = triton_gemm.GemmTile(32, 32, 32, num_warps=4, num_stages=2, k_split=8, flat_k=True)
    assert count_bit_differences(_gemm(x, w, b, "split"), _gemm(x, w, b, "serial", eight)) > 0


def _fused_launch(x, w, bias, sems):
    """fixed_tile_gemm_fused_kernel on the given counters: (output, counters after the launch)."""

    fused = dataclasses.replace(TILE, fused_reduce=True)
    m, k = x.shape
    n = w.shape[1]
    (grid, consts), _ = triton_gemm._launches(m, k, n, x.dtype, bias, fused, "split")
    parts = torch.zeros((fused.k_split, m, n), dtype=torch.float32)
    out = torch.zeros((m, n), dtype=torch.float32)
    sems = torch.full((grid[0],), sems, dtype=torch.int32) if isinstance(sems, int) else sems
    triton_gemm.torch_launch(triton_gemm.kernels().fixed_tile_gemm_fused_kernel,
                             (x, w, w if bias is None else bias, m, sems), (parts, out, sems),
                             grid, num_warps=4, num_stages=2, **triton_gemm._fused(consts))
    return out.numpy(), sems


def test_the_fused_reduce_leaves_its_counters_zero(operands):
    """Each tile's last program puts the tile's counter back to zero, so the step threads one
    counter buffer through its launches without a memset between them (_triton_launch.Counters):
    two launches on the same counters, not re-zeroed, give the unfused reduce's bits."""
    x, w, b = operands
    ref = _gemm(x, w, b, "split")
    out, sems = _fused_launch(x, w, b, 0)
    assert count_bit_differences(ref, out) == 0 and int(sems.abs().sum()) == 0
    again, sems = _fused_launch(x, w, b, sems)
    assert count_bit_differences(ref, again) == 0 and int(sems.abs().sum()) == 0


def test_the_fused_reduce_negative_control_a_counter_one_ahead_differs(operands):
    """The checks above can fail: with every counter starting at 1 instead of 0, a tile's next-to-
    last program already adds the chunks, one of them not yet stored, and its outputs differ; and
    the counters end at 1 (the last program counts after the reset), not zero."""
    x, w, _ = operands
    out, sems = _fused_launch(x, w, None, 1)
    assert count_bit_differences(_gemm(x, w, None, "split"), out) > 0
    assert (sems == 1).all()


def test_negative_control_another_k_split_changes_the_bits(operands):
    x, w, b = operands
    two = triton_gemm.GemmTile(32, 32, 32, num_warps=4, num_stages=2, k_split=2)
    assert count_bit_differences(_gemm(x, w, b, "serial"), _gemm(x, w, b, "serial", two)) > 0


def test_schedule_choice_and_tile_check():
    assert triton_gemm.schedule_for(1, 4096, triton_gemm.tile_for(4096, 4096, "bf16")) == "split"
    # At prefill M every Llama-3-8B entry runs the serial schedule in one flat K loop (flat_k);
    # before it, q/o/k/v and down split at every M (their per-chunk serial form was 2-2.5x slower).
    for n, k in ((4096, 4096), (4096, 14336), (14336, 4096)):
        tile = triton_gemm.tile_for(n, k, "bf16")
        assert (triton_gemm.schedule_for(4096, n, tile), tile.flat_k) == ("serial", True), (n, k)
    assert triton_gemm.schedule_for(4096, 99, triton_gemm.GemmTile(32, 32, 32, k_split=4)) == "serial"
    assert triton_gemm.schedule_for(1, 131072, triton_gemm.tile_for(131072, 4096, "bf16")) == "serial"
    for (n, k, _), tile in triton_gemm_tiles.TILES.tuned().items():
        assert k % (tile.k_split * tile.block_k) == 0, (n, k, tile)
    bad = triton_gemm.GemmTile(32, 32, 32, k_split=3)
    with pytest.raises(ValueError, match="K=256 is not a multiple of k_split"):
        triton_gemm.gemm_triton_torch(torch.zeros(2, 256), torch.zeros(256, 8), out_dtype="f32",
                                      tile=bad)


# -- the grouped launch (q/k/v, gate/up) ------------------------------------------------------------


@pytest.fixture(scope="module")
def members():
    rng = np.random.default_rng(1)
    ws = [torch.from_numpy(rng.standard_normal((K, n)).astype(np.float32)) for n in (80, 32, 40)]
    bs = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for n in (80, 32, 40)]
    return ws, bs


@pytest.fixture()
def one_tile(monkeypatch):
    """Every member on TILE, as the tuned table gives q/k/v and gate/up one tile each."""
    monkeypatch.setattr(triton_gemm, "tile_for", lambda n, k, dtype, m=None: TILE)


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("schedule", ["serial", "split"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_outputs_are_each_members_own_launch(operands, members, one_tile, count, schedule,
                                                     with_bias):
    x = operands[0]
    ws, bs = members[0][:count], (members[1][:count] if with_bias else None)
    for m in (1, 33, 70):  # 70: a partial second row tile
        outs = triton_gemm.gemm_group_triton_torch(x[:m], ws, bs, out_dtype="f32",
                                                   schedule=schedule)
        assert len(outs) == count
        for i, w in enumerate(ws):
            alone = _gemm(x[:m], w, None if bs is None else bs[i], schedule)
            assert count_bit_differences(alone, outs[i].numpy()) == 0, (m, i)


def test_grouped_negative_control_a_shifted_member_differs(operands, members, one_tile):
    """The check can fail: a member read through a wrong weight (k's columns for v) differs."""
    x = operands[0]
    ws = members[0]
    outs = triton_gemm.gemm_group_triton_torch(x, [ws[0], ws[1], ws[1][:, :32]], None,
                                               out_dtype="f32")
    assert count_bit_differences(_gemm(x, ws[1], None, "serial"), outs[2].numpy()) == 0
    assert count_bit_differences(_gemm(x, ws[0][:, :32], None, "serial"), outs[2].numpy()) > 0


def test_group_tile_falls_back_when_members_cannot_share_a_launch(operands, members):
    x = operands[0]
    ws, bs = members
    # Unpatched tile_for: f32 has one tile, so these share; a bias on one member only does not.
    assert triton_gemm.group_tile(x, ws, None) is not None
    assert triton_gemm.group_tile(x, ws, [bs[0], None, bs[2]]) is None
    assert triton_gemm.group_tile(x, ws[:1], None) is None
    # bf16: the tuned table gives q/k/v (4096 and 1024 wide at K = 4096) and gate/up one tile.
    xb = torch.zeros(1, 4096, dtype=torch.bfloat16)
    qkv = [torch.zeros(4096, n, dtype=torch.bfloat16) for n in (4096, 1024, 1024)]
    assert triton_gemm.group_tile(xb, qkv, None) == triton_gemm.tile_for(4096, 4096, "bf16", 1)
    x65 = torch.zeros(65, 4096, dtype=torch.bfloat16)  # past the decode launch shapes (by_m)
    assert triton_gemm.group_tile(x65, qkv, None) == triton_gemm.tile_for(4096, 4096, "bf16", 65)
    x1024 = torch.zeros(1024, 4096, dtype=torch.bfloat16)  # a prefill: the entries' wide tile,
    assert not triton_gemm.tile_for(4096, 4096, "bf16").grouped  # marked ungrouped (measured)
    assert triton_gemm.group_tile(x1024, qkv, None) is None
    mixed = [torch.zeros(4096, n, dtype=torch.bfloat16) for n in (4096, 14336)]
    assert triton_gemm.group_tile(xb, mixed, None) is None
    # ...and then the grouped call is one launch per member, still the members' own bits.
    outs = triton_gemm.gemm_group_triton_torch(x[:3], [ws[0], ws[1]], [bs[0], None],
                                               out_dtype="f32")
    alone = triton_gemm.gemm_triton_torch(x[:3], ws[1], out_dtype="f32")  # its own tile_for
    assert count_bit_differences(alone.numpy(), outs[1].numpy()) == 0


def test_an_ungrouped_tile_launches_each_member_alone_with_the_same_bits(operands, members,
                                                                         monkeypatch):
    """A tile with grouped=False (its grouped form measured slower) gives no group tile, and the
    grouped call then launches every member on its own -- the bits of the one launch."""
    x, (ws, bs) = operands[0][:33], members
    monkeypatch.setattr(triton_gemm, "tile_for", lambda n, k, dtype, m=None: TILE)
    assert triton_gemm.group_tile(x, ws, bs) == TILE  # the control: the same tile, grouped
    one_launch = triton_gemm.gemm_group_triton_torch(x, ws, bs, out_dtype="f32")
    alone_tile = dataclasses.replace(TILE, grouped=False)
    monkeypatch.setattr(triton_gemm, "tile_for", lambda n, k, dtype, m=None: alone_tile)
    assert triton_gemm.group_tile(x, ws, bs) is None
    launched = []
    real = triton_gemm.gemm_triton_torch
    monkeypatch.setattr(triton_gemm, "gemm_triton_torch",
                        lambda *a, **kw: launched.append(a[1].shape) or real(*a, **kw))
    outs = triton_gemm.gemm_group_triton_torch(x, ws, bs, out_dtype="f32")
    assert launched == [w.shape for w in ws]
    for i in range(len(ws)):
        assert count_bit_differences(one_launch[i].numpy(), outs[i].numpy()) == 0, i
