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
