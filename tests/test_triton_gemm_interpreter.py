"""The split-K GEMM's two schedules, on the CPU, under Triton's interpreter.

The interpreter runs the kernel source with numpy, so this checks the logic -- chunk bounds, masks,
the partial buffer, the reduce kernel's order and bias -- not the GPU's bits (those:
scripts/gpu_validate.py on the H200, where rows at M = 1..64 run the split schedule and M = 512
the serial one). Skipped where triton or torch is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

from pallas_kernels import triton_gemm  # noqa: E402

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


def test_negative_control_another_k_split_changes_the_bits(operands):
    x, w, b = operands
    two = triton_gemm.GemmTile(32, 32, 32, num_warps=4, num_stages=2, k_split=2)
    assert count_bit_differences(_gemm(x, w, b, "serial"), _gemm(x, w, b, "serial", two)) > 0


def test_schedule_choice_and_tile_check():
    assert triton_gemm.schedule_for(1, 4096, triton_gemm.tile_for(4096, 4096, "bf16")) == "split"
    assert triton_gemm.schedule_for(4096, 4096, triton_gemm.tile_for(4096, 4096, "bf16")) == "serial"
    assert triton_gemm.schedule_for(1, 131072, triton_gemm.tile_for(131072, 4096, "bf16")) == "serial"
    for (n, k), tile in triton_gemm.TUNED_BF16_TILES.items():
        assert k % (tile.k_split * tile.block_k) == 0, (n, k, tile)
    bad = triton_gemm.GemmTile(32, 32, 32, k_split=3)
    with pytest.raises(ValueError, match="K=256 is not a multiple of k_split"):
        triton_gemm.gemm_triton_torch(torch.zeros(2, 256), torch.zeros(256, 8), out_dtype="f32",
                                      tile=bad)
