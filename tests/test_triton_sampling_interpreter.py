"""The Triton block_sumexp kernel completes a short last block, on the CPU under Triton's interpreter.

Any vocabulary size: the columns past the vocabulary are loaded as -inf logits, whose exp is +0.0,
so the last block's partial is the block tree over the completed row (pallas_kernels/logprobs.py).
The interpreter's exp is numpy's, so the reference here is numpy's halving tree over numpy's exp of
the completed row; the GPU's bits (libdevice exp) are checked on the H200 (scripts/gpu_validate.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import triton_interpreter  # noqa: F401  (must precede the kernel import)
from tests.bits import count_bit_differences, numpy_halving_tree, shifted_logits_and_completed

torch = pytest.importorskip("torch")
if not triton_interpreter.AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

from pallas_kernels import triton_sampling  # noqa: E402


@pytest.mark.parametrize("vocab,block", [(151936, 32768), (20000, 16384), (65536, 32768)])
def test_last_block_completed_with_neg_inf(vocab, block):
    shifted, completed = shifted_logits_and_completed(3, vocab, block, seed=vocab)
    blocks = completed.shape[1] // block
    got = triton_sampling.block_sumexp_triton_torch(torch.from_numpy(shifted), block_size=block)
    assert tuple(got.shape) == (3, blocks)
    want = numpy_halving_tree(np.exp(completed).reshape(3, blocks, block))
    assert count_bit_differences(got.numpy(), want) == 0
    padded = triton_sampling.block_sumexp_triton_torch(torch.from_numpy(completed), block_size=block)
    assert count_bit_differences(got.numpy(), padded.numpy()) == 0


def test_negative_control_truncated_tree_differs():
    rng = np.random.default_rng(1)
    vocab, block = 151936, 32768
    x = (rng.standard_normal((16, vocab)) * 3).astype(np.float32)
    shifted = x - x.max(-1, keepdims=True)
    got = triton_sampling.block_sumexp_triton_torch(torch.from_numpy(shifted), block_size=block)
    truncated = numpy_halving_tree(np.exp(shifted[:, (vocab // block) * block:]))
    assert count_bit_differences(got.numpy()[:, -1], truncated) > 0
