"""Rotary position tables, built once at load time: ``cos``/``sin`` [max_positions, head_dim].

The tables follow HF transformers' construction step by step (``rope_init_fn`` then the rotary
embedding's forward): inverse frequencies, ``angle = position * inv_freq`` (one f32 multiply),
``emb = concat(angle, angle)``, ``cos(emb) * attention_scaling`` rounded to the model dtype.

They are computed *eagerly*, one XLA operation at a time, on purpose: inside a jitted program XLA
may fuse the multiply into the cosine's range reduction and contract it into an FMA, which rounds
differently from the trainer's op-by-op evaluation. Op by op, every basic operation is correctly
rounded on both sides and only the transcendental functions (pow, cos, sin) need the shared
implementation that trainer mode routes torch's versions to (interop.trainer_mode).

``device`` selects where they are computed: "cpu" (XLA:CPU) or "device" (the default accelerator);
the YaRN pair of switches maps onto it (docs/numerics.md). Supported rope types: default, llama3,
yarn. Bitwise trainer alignment is validated for the default type; llama3 and yarn are checked
against HF to float tolerance only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _device(where: str):
    if where == "cpu":
        return jax.devices("cpu")[0]
    return jax.devices()[0]


def inv_freq_and_scaling(head_dim: int, rope_theta: float, rope_scaling: dict | None,
                         max_position_embeddings: int) -> tuple[jax.Array, float]:
    """HF ``ROPE_INIT_FUNCTIONS`` for default / llama3 / yarn, evaluated op by op in f32."""
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    exponent = jnp.arange(0, head_dim, 2, dtype=jnp.int32).astype(jnp.float32) / jnp.float32(head_dim)
    pos_freqs = jnp.float32(rope_theta) ** exponent
    inv_freq = jnp.float32(1.0) / pos_freqs
    if rope_type in ("default", None):
        return inv_freq, 1.0
    if rope_type == "llama3":
        factor = rope_scaling["factor"]
        low = rope_scaling["low_freq_factor"]
        high = rope_scaling["high_freq_factor"]
        old_ctx = rope_scaling["original_max_position_embeddings"]
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = jnp.float32(2 * math.pi) / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / jnp.float32(factor), inv_freq)
        smooth = (jnp.float32(old_ctx) / wavelen - jnp.float32(low)) / jnp.float32(high - low)
        smoothed = (1 - smooth) * scaled / jnp.float32(factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return jnp.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        factor = rope_scaling["factor"]
        beta_fast = rope_scaling.get("beta_fast") or 32
        beta_slow = rope_scaling.get("beta_slow") or 1
        original = rope_scaling.get("original_max_position_embeddings") or max_position_embeddings
        attention_factor = rope_scaling.get("attention_factor")
        if attention_factor is None:
            mscale = rope_scaling.get("mscale")
            mscale_all = rope_scaling.get("mscale_all_dim")

            def get_mscale(scale, m=1.0):
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if mscale and mscale_all:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
            else:
                attention_factor = get_mscale(factor)

        def correction_dim(num_rot):
            return (head_dim * math.log(original / (num_rot * 2 * math.pi))) / (2 * math.log(rope_theta))

        low = math.floor(correction_dim(beta_fast))
        high = math.ceil(correction_dim(beta_slow))
        if rope_scaling.get("truncate", True) is False:
            low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = (jnp.arange(head_dim // 2, dtype=jnp.float32) - jnp.float32(low)) / jnp.float32(high - low)
        extrapolation_factor = 1 - jnp.clip(ramp, 0, 1)
        interpolation = jnp.float32(1.0) / (jnp.float32(factor) * pos_freqs)
        extrapolation = jnp.float32(1.0) / pos_freqs
        inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
        return inv, float(attention_factor)
    raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported "
                     "(supported: default, llama3, yarn)")


def rope_tables(head_dim: int, rope_theta: float, rope_scaling: dict | None,
                max_positions: int, dtype, *, device: str = "device") -> tuple[jax.Array, jax.Array]:
    """cos, sin [max_positions, head_dim] in ``dtype``, built op by op (not jitted)."""
    with jax.default_device(_device(device)):
        inv_freq, scaling = inv_freq_and_scaling(head_dim, rope_theta, rope_scaling, max_positions)
        positions = jnp.arange(max_positions, dtype=jnp.int32).astype(jnp.float32)
        angle = positions[:, None] * inv_freq[None, :]
        emb = jnp.concatenate([angle, angle], axis=-1)
        cos = (jnp.cos(emb) * jnp.float32(scaling)).astype(dtype)
        sin = (jnp.sin(emb) * jnp.float32(scaling)).astype(dtype)
    target = jax.devices()[0]
    return jax.device_put(cos, target), jax.device_put(sin, target)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF form in the model dtype: ``x * cos + rotate_half(x) * sin``, each op rounded.

    x [T, H, D]; cos, sin [T, D]. Exact elementwise glue (three rounded ops), no reduction.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]

