"""Rotary position tables, built once at load time: ``cos``/``sin`` [max_positions, head_dim].

The inverse frequencies follow HF transformers' ``ROPE_INIT_FUNCTIONS`` (default, llama3, yarn)
*as torch evaluates them*, op by op in float32, and the tables follow the rotary embedding's
forward: ``angle = position * inv_freq`` (one f32 multiply), ``emb = concat(angle, angle)``,
``cos(emb) * attention_scaling`` rounded to the model dtype.

Three things decide those bits, and each is pinned here on purpose:

* **Where the IEEE operations run.** torch's +, -, *, / are correctly rounded on the CPU and on
  CUDA; XLA's f32 division on a GPU is not (platform-facts.md: 567,416 of 4M quotients differ),
  and an inverse frequency one ulp off moves a bf16 cos/sin entry a few dozen positions in (the
  H200 alignment at head_dim 128 failed this way from position 44). So every add, multiply and
  division of the frequencies runs on the host in numpy float32 -- the same correctly rounded
  results torch gives on either device.
* **Which torch spelling.** ``1.0 / t`` is ``t.reciprocal() * 1.0`` in torch (``__rtruediv__``),
  on every device; ``t / s`` with a Python number ``s`` divides on the CPU but multiplies by the
  f32 reciprocal of ``s`` on CUDA (ATen's ``div_true_kernel_cuda``). `TorchF32` spells each.
  ``--yarn-frequency-device`` says where the trainer computed its frequencies (``device`` = the
  accelerator, i.e. CUDA semantics on a GPU), ``--yarn-ramp-mask-device`` where it built the YaRN
  ramp (HF builds it on the CPU, then moves it).
* **pow, cos and sin** are XLA's, on the accelerator: the functions trainer mode routes torch's to
  (interop.trainer_mode), so engine and trainer evaluate one implementation.

Trainer mode takes its inverse frequencies from `inv_freq_and_scaling` itself, so engine and
trainer agree by construction on every rope type; the torch spellings keep those values what HF's
own code computes with the same pow. Bitwise alignment is validated for default and llama3 (CPU
tests, docs/gpu-validation.md); yarn follows HF's code but has no alignment run yet.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# HF's rotate-half form lives with the portable rope_write leaf (the GQA attention layer runs it
# through its planned leaf); MLA's rope dimensions call it from here.
from pallas_kernels.rope_write import apply_rope  # noqa: F401

F32 = np.float32


class TorchF32:
    """torch's float32 arithmetic on a CPU ("cpu") or CUDA ("cuda") tensor, evaluated on the host.

    Arrays are numpy float32; numpy's elementwise +, -, *, / are correctly rounded, as torch's are.
    """

    def __init__(self, semantics: str, pow_device) -> None:
        if semantics not in ("cpu", "cuda"):
            raise ValueError(f"semantics={semantics!r} must be 'cpu' or 'cuda'")
        self.semantics = semantics
        self.pow_device = pow_device

    @staticmethod
    def rdiv(scalar: float, t: np.ndarray) -> np.ndarray:
        """``scalar / t``: torch's ``t.reciprocal() * scalar``."""
        return (F32(1.0) / t) * F32(scalar)

    def div(self, t: np.ndarray, scalar: float) -> np.ndarray:
        """``t / scalar`` with a Python number: CUDA multiplies by the reciprocal, the CPU divides."""
        if self.semantics == "cuda":
            return t * (F32(1.0) / F32(scalar))
        return t / F32(scalar)

    def pow(self, base: float, t: np.ndarray) -> np.ndarray:
        """``base ** t``: XLA's pow (trainer mode's route for torch's), padded to a multiple of 16
        elements as the trainer's twin is (XLA:CPU evaluates short 1-D tails on another path)."""
        n = t.shape[0]
        padded = np.ones(max(16, -(-n // 16) * 16), F32)
        padded[:n] = t
        with jax.default_device(self.pow_device):
            out = jnp.power(jnp.asarray(base, jnp.float32), jnp.asarray(padded))
        return np.asarray(out)[:n]


def _device(where: str):
    if where == "cpu":
        return jax.devices("cpu")[0]
    return jax.devices()[0]


def semantics_of(where: str) -> str:
    """"cpu" or "device" -> the torch semantics of a trainer computing there."""
    if where not in ("cpu", "device"):
        raise ValueError(f"device={where!r} must be 'cpu' or 'device'")
    return "cuda" if where == "device" and jax.default_backend() == "gpu" else "cpu"


def _arange_f32(n: int, step: int = 1) -> np.ndarray:
    return np.arange(0, n, step, dtype=np.int64).astype(F32)  # integers: exact in f32


def inv_freq_and_scaling(head_dim: int, rope_theta: float, rope_scaling: dict | None,
                         max_position_embeddings: int, *, frequency_device: str = "device",
                         ramp_device: str = "cpu") -> tuple[np.ndarray, float]:
    """HF ``ROPE_INIT_FUNCTIONS`` for default / llama3 / yarn, as torch evaluates them.

    Returns (inv_freq f32[head_dim // 2], attention_scaling).
    """
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    t = TorchF32(semantics_of(frequency_device), _device(frequency_device))
    dim = head_dim

    def default_inv_freq():
        # 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        return t.rdiv(1.0, t.pow(rope_theta, t.div(_arange_f32(dim, 2), dim)))

    if rope_type in ("default", None):
        return default_inv_freq(), 1.0
    if rope_type == "llama3":
        inv_freq = default_inv_freq()
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = F32(old_context_len / low_freq_factor)  # Python floats, compared in f32
        high_freq_wavelen = F32(old_context_len / high_freq_factor)
        wavelen = t.rdiv(2 * math.pi, inv_freq)
        inv_freq_llama = np.where(wavelen > low_freq_wavelen, t.div(inv_freq, factor), inv_freq)
        smooth_factor = t.div(t.rdiv(old_context_len, wavelen) - F32(low_freq_factor),
                              high_freq_factor - low_freq_factor)
        smoothed = t.div((F32(1) - smooth_factor) * inv_freq_llama, factor) + \
            smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(is_medium, smoothed, inv_freq_llama).astype(F32), 1.0
    if rope_type == "yarn":
        return _yarn(t, TorchF32(semantics_of(ramp_device), _device(ramp_device)), dim,
                     rope_theta, rope_scaling, max_position_embeddings)
    raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported "
                     "(supported: default, llama3, yarn)")


def _yarn(t: TorchF32, ramp_ops: TorchF32, dim: int, base: float, rope_scaling: dict,
          max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """HF's ``_compute_yarn_parameters``: the ramp on ``ramp_ops``' device, the rest on ``t``'s."""
    factor = rope_scaling["factor"]
    original = rope_scaling.get("original_max_position_embeddings") or max_position_embeddings
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        mscale, mscale_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a singularity
    # linear_ramp_factor: (arange(dim // 2) - low) / (high - low), clamped to [0, 1]
    ramp = np.clip(ramp_ops.div(_arange_f32(dim // 2) - F32(low), high - low), F32(0), F32(1))
    pos_freqs = t.pow(base, t.div(_arange_f32(dim, 2), dim))
    extrapolation = t.rdiv(1.0, pos_freqs)
    interpolation = t.rdiv(1.0, F32(factor) * pos_freqs)
    extrapolation_factor = F32(1) - ramp
    inv_freq = interpolation * (F32(1) - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(F32), float(attention_factor)


def rope_tables(head_dim: int, rope_theta: float, rope_scaling: dict | None,
                max_positions: int, dtype, *, frequency_device: str = "device",
                ramp_device: str = "cpu") -> tuple[jax.Array, jax.Array]:
    """cos, sin [max_positions, head_dim] in ``dtype`` on the accelerator.

    The angles are one correctly rounded f32 multiply each (host); cos, sin and the scaling run on
    the accelerator, eagerly, where HF's forward runs them (a jitted program could fuse the multiply
    into the cosine's range reduction).
    """
    inv_freq, scaling = inv_freq_and_scaling(head_dim, rope_theta, rope_scaling, max_positions,
                                             frequency_device=frequency_device,
                                             ramp_device=ramp_device)
    angle = _arange_f32(max_positions)[:, None] * inv_freq[None, :]
    emb = jnp.asarray(np.concatenate([angle, angle], axis=-1))
    cos = (jnp.cos(emb) * jnp.float32(scaling)).astype(dtype)
    sin = (jnp.sin(emb) * jnp.float32(scaling)).astype(dtype)
    return cos, sin


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's ``apply_rotary_pos_emb_interleave`` (DeepSeek's ``rope_interleave``): dimension pairs
    (x0, x1), (x2, x3), ... each rotated by one frequency, the outputs laid out
    ``concat(x_even * cos - x_odd * sin, x_odd * cos + x_even * sin)``; each op rounded in the
    model dtype, in that order. x [T, H, D]; cos, sin [T, D] (``concat(angle, angle)`` tables: the
    first half holds each pair's angle)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([even * c - odd * s, odd * c + even * s], axis=-1)
