"""The SiLU kernel's SwiGLU form (``times``) on the CPU, under Triton's interpreter: the SiLU
rounded to the dtype, then the product rounded again -- the trainer's ``act_fn(gate) * up`` -- in
f32, where the interpreter's arithmetic is IEEE (its bf16 conversion is not round-to-nearest-even:
bf16 is checked on the H200, scripts/gpu_validate.py ``silu times up``, and by the goldens)."""

from __future__ import annotations

import numpy as np
import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

from pallas_kernels import triton_activation  # noqa: E402


def test_times_is_the_silu_then_the_multiply():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=gen) * 4  # 2100 elements: a partial last block
    up = torch.randn(7, 300, generator=gen)
    fused = triton_activation.silu_triton_torch(x, times=up).numpy()
    alone = triton_activation.silu_triton_torch(x)
    assert count_bit_differences(fused, (alone * up).numpy()) == 0
    # Control: one rounding of the exact product (no rounding of the SiLU first) is another
    # number in some elements, so the comparison above can fail.
    x64, up64 = x.double().numpy(), up.double().numpy()
    once = (x64 / (1 + np.exp(-x64)) * up64).astype(np.float32)
    assert count_bit_differences(fused, once) > 0


def test_times_must_match_x():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"times has shape \(4, 7\)"):
        triton_activation.silu_triton_torch(x, times=torch.zeros(4, 7))
