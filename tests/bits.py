"""Bit-level comparison helpers: a bitwise claim compares float bits, never values."""

import numpy as np


def float_bits(x) -> np.ndarray:
    """The IEEE bit patterns of a float array (16-bit floats widened exactly to f32 first)."""
    a = np.asarray(x)
    if a.dtype.itemsize == 2:  # bf16 and f16 widen to f32 exactly
        a = a.astype(np.float32)
    width = {4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return np.ascontiguousarray(a).view(width)


def count_bit_differences(a, b) -> int:
    """Elements whose bits differ (so -0.0 != +0.0 and NaN payloads count)."""
    a_bits, b_bits = float_bits(a), float_bits(b)
    if a_bits.shape != b_bits.shape:
        raise AssertionError(f"shapes differ: {a_bits.shape} vs {b_bits.shape}")
    return int(np.count_nonzero(a_bits != b_bits))


def shifted_logits_and_completed(rows: int, vocab: int, block: int, seed: int):
    """Random logits minus their row max [rows, vocab], and the same rows completed with -inf to a
    whole number of blocks (what the block_sumexp leaves must treat them as)."""
    x = (np.random.default_rng(seed).standard_normal((rows, vocab)) * 3).astype(np.float32)
    shifted = x - x.max(-1, keepdims=True)
    completed = np.full((rows, -(-vocab // block) * block), -np.inf, np.float32)
    completed[:, :vocab] = shifted
    return shifted, completed


def numpy_halving_tree(e: np.ndarray) -> np.ndarray:
    """pallas_kernels.logprobs.tree_sum_last over the last axis, written with numpy's elementwise
    f32 adds (IEEE on any CPU; no reduction whose order numpy chooses)."""
    while e.shape[-1] > 1:
        n = e.shape[-1]
        h = n // 2
        paired = e[..., :h] + e[..., h:2 * h]
        e = paired if n % 2 == 0 else np.concatenate([paired, e[..., 2 * h:]], axis=-1)
    return e[..., 0]
