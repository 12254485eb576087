"""The routed experts' Triton GEMM (("moe", "grouped_gemm"), triton_moe_grouped_gemm.py) on the CPU,
under Triton's interpreter: each row has the bits the dense Triton gemm gives that row with its
expert's weight, on both schedules, for a random and a skewed routing; empty tiles are zeros.

The interpreter checks the logic (the tile -> expert map, the weight offset, masks, the empty-tile
branch, the split partials), not the GPU's bits: scripts/gpu_grouped_gemm.py checks those on the
H200. Skipped where triton or torch is missing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

from pallas_kernels import triton_gemm, triton_moe_grouped_gemm  # noqa: E402
from pallas_kernels.moe_grouped_gemm import plan_expert_tiles  # noqa: E402

TILE = triton_gemm.GemmTile(32, 32, 32, num_warps=4, num_stages=2, k_split=4)
K, N, E, T, TOP_K = 256, 80, 3, 20, 2  # N not a multiple of BN: masked columns
BLOCK_ROWS = 64  # two program tiles (BM 32) per expert block


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((T, K)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((E, K, N)).astype(np.float32))
    return x, w


def _layout(ids):
    order, tile_expert, row_of_pair = plan_expert_tiles(jnp.asarray(ids, jnp.int32), E, BLOCK_ROWS)
    return (torch.from_numpy(np.asarray(order).astype(np.int64)),
            torch.from_numpy(np.array(tile_expert)), np.asarray(row_of_pair))


def _rows(x, order):
    """x's token rows in the layout; padding rows hold 7.0 (not zeros), which an empty tile
    must not pass through."""
    token = order // TOP_K
    rows = torch.full((len(order), K), 7.0)
    real = token < T
    rows[real] = x[token[real]]
    return rows


def _grouped(rows, w, tile_expert, schedule, block_rows=BLOCK_ROWS, tile=TILE):
    return triton_moe_grouped_gemm.grouped_gemm_triton_torch(
        rows, w, tile_expert, block_rows=block_rows, out_dtype="f32", tile=tile,
        schedule=schedule).numpy()


def _dense(x, w, schedule):
    """[E, T, N]: the dense Triton gemm of every token row with every expert."""
    return np.stack([triton_gemm.gemm_triton_torch(x, w[e], out_dtype="f32", tile=TILE,
                                                   schedule=schedule).numpy() for e in range(E)])


ROUTINGS = {"random": np.stack([np.random.default_rng(t).permutation(E)[:TOP_K] for t in range(T)]),
            "skewed": np.stack([[1, 2]] * T)}  # every token to experts 1 and 2: one tile idle


@pytest.mark.parametrize("schedule", ["serial", "split"])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_each_row_has_the_dense_gemms_bits(operands, schedule, routing):
    x, w = operands
    ids = ROUTINGS[routing]
    order, tile_expert, row_of_pair = _layout(ids)
    out = _grouped(_rows(x, order), w, tile_expert, schedule)
    dense = _dense(x, w, "serial")  # the schedules agree (test_triton_gemm_interpreter.py)
    per_pair = out[row_of_pair]     # [T, k, N]
    assert count_bit_differences(per_pair, dense[ids, np.arange(T)[:, None]]) == 0
    empty = np.repeat(tile_expert.numpy() < 0, BLOCK_ROWS)
    assert empty.any() == (routing == "skewed")
    assert not out[empty].any() and count_bit_differences(out[empty], 0 * out[empty]) == 0


def test_the_flat_k_loop_keeps_the_dense_bits(operands):
    """A tile's flat_k (the serial chunks in one K loop) in the expert launch: every routed row
    still has the dense gemm's bits, and an empty tile still stores zeros."""
    import dataclasses

    x, w = operands
    ids = ROUTINGS["skewed"]
    order, tile_expert, row_of_pair = _layout(ids)
    out = _grouped(_rows(x, order), w, tile_expert, "serial",
                   tile=dataclasses.replace(TILE, flat_k=True))
    dense = _dense(x, w, "split")
    assert count_bit_differences(out[row_of_pair], dense[ids, np.arange(T)[:, None]]) == 0
    empty = np.repeat(tile_expert.numpy() < 0, BLOCK_ROWS)
    assert empty.any() and not out[empty].any()


def test_negative_control_a_wrong_tile_map_changes_the_bits(operands):
    x, w = operands
    order, tile_expert, row_of_pair = _layout(ROUTINGS["random"])
    right = _grouped(_rows(x, order), w, tile_expert, "serial")
    wrong = _grouped(_rows(x, order), w, torch.roll(tile_expert, 1), "serial")
    assert count_bit_differences(right[row_of_pair], wrong[row_of_pair]) > 0


def test_block_rows_must_hold_whole_program_tiles(operands):
    w = operands[1]
    with pytest.raises(ValueError, match="block_rows=16 must be a multiple of the tile's "
                                         "block_m=32"):
        _grouped(torch.zeros(48, K), w, torch.zeros(3, dtype=torch.int32), "serial", 16)
