"""Multi-head latent attention (DeepSeek-V2/V3), absorbed, over one latent KV page per position.

HF's `DeepseekV3Attention` with the order of operations the engine runs:

  q        = q_b_proj(q_a_layernorm(q_a_proj(x)))   (or q_proj(x) when q_lora_rank is None)
  q_nope, q_rope = split(q per head, [qk_nope_head_dim, qk_rope_head_dim]); q_rope = rope(q_rope)
  c, k_rope = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])
  c        = kv_a_layernorm(c);  k_rope = rope(k_rope)        (one rotary key for every head)
  latent   = concat(c, k_rope)  -> written to the layer's LatentPages, once, at this position
  q_latent = q_nope W_UK   per head (W_UK: kv_b_proj's key rows), a GEMM rounded to the model dtype
  out_lat  = attention(concat(q_latent, q_rope), latents)  the ("attention", "mla_paged") leaf
  out      = out_lat W_UV  per head (W_UV: kv_b_proj's value rows), a GEMM rounded again
  o_proj(out)

HF instead expands every cached latent into per-head keys and values (k_nope = c W_UK, v = c W_UV)
and attends over those: the same function, other roundings (docs/models.md has the measured gap).
The absorbed form is what the engine caches (kv_lora_rank + qk_rope_head_dim values per position
instead of heads x (qk_head_dim + v_head_dim)) and what trainer mode runs in HF's model
(interop/trainer_mla.py), so teacher-forced logprobs agree by construction.

LongCat-Flash's MLA (`cfg.mla_lora_scale`) multiplies by two LoRA norm scales, HF's
`mla_scale_q_lora` = sqrt(hidden / q_lora_rank) and `mla_scale_kv_lora` = sqrt(hidden / kv_lora_rank)
(Python floats). Where they go is `--mla-lora-scale` (`lora_scale`):

  runtime   q = q * s_q after q_b_proj (before the split and rope), c = c * s_kv after kv_a_layernorm
            (the rotary key unscaled): each an f32 product rounded to the model dtype, which is what
            torch's bf16 tensor * Python float computes -- HF's LongcatFlashMLA, so the trainer's
            bits (rl-bitwise pins it);
  folded    q_a_layernorm.weight * s_q and kv_a_layernorm.weight * s_kv, each rounded to the model
            dtype once, as SGLang folds them at load: one rounding fewer on the activations, other
            bits. The held weights stay HF's (named_parameters, weight updates, Orbax see the
            checkpoint's); the folded norm weight is formed from them in the forward, a [rank]
            vector product with exactly the bits a fold at load gives, so a partial weight update
            can never fold a weight twice.

Every GEMM is the model's planned gemm leaf, each head's its own call (a head's bits never depend on
how many heads share a launch); the two rounding boundaries around the attention leaf (q_latent,
out_lat in the model dtype) are the ones the trainer's twins see.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from jengine.models.kv_cache import LatentPages
from jengine.models.layers.linear import Linear, linears
from jengine.models.layers.norm import RMSNorm
from jengine.models.layers.rope import apply_rope, apply_rope_interleaved

# HF builds q_a_layernorm and kv_a_layernorm as DeepseekV3RMSNorm(width): its default eps, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg) -> float:
    """HF's `DeepseekV3Attention.scaling`: qk_head_dim ** -0.5, times mscale(factor,
    mscale_all_dim) squared under a scaled rope (YaRN) that gives mscale_all_dim; Python floats, as
    HF computes them."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** (-0.5)
    rope = cfg.rope_scaling or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim", 0):
        factor = rope["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


LORA_SCALES = ("runtime", "folded")


def lora_scales(cfg) -> tuple[float, float]:
    """HF's (mla_scale_q_lora, mla_scale_kv_lora): sqrt(hidden / rank) as Python floats."""
    return ((cfg.hidden_size / cfg.q_lora_rank) ** 0.5, (cfg.hidden_size / cfg.kv_lora_rank) ** 0.5)


def scaled(x, scale: float, dtype):
    """x * scale as an f32 product rounded to `dtype`: torch's `bf16 tensor * python float`."""
    return (x.astype(jnp.float32) * jnp.float32(scale)).astype(dtype)


class MLAttention(nnx.Module):
    defers_projection = False  # o_proj runs here (no pending= form; dense.py)

    @staticmethod
    def specs(cfg, *, dtype) -> dict[str, dict]:
        h, n, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        bias = bool(cfg.attention_bias)
        specs = {}
        if cfg.q_lora_rank:
            specs["q_a_proj"] = Linear.specs(h, cfg.q_lora_rank, ("embed", "latent"), bias=bias,
                                             dtype=dtype)
            specs["q_a_layernorm"] = RMSNorm.specs(cfg.q_lora_rank, "latent", dtype=dtype)
            specs["q_b_proj"] = Linear.specs(cfg.q_lora_rank, n * qk, ("latent", "heads"),
                                             bias=False, dtype=dtype)
        else:
            specs["q_proj"] = Linear.specs(h, n * qk, ("embed", "heads"), bias=False, dtype=dtype)
        specs["kv_a_proj_with_mqa"] = Linear.specs(h, r + cfg.qk_rope_head_dim, ("embed", "latent"),
                                                   bias=bias, dtype=dtype)
        specs["kv_a_layernorm"] = RMSNorm.specs(r, "latent", dtype=dtype)
        specs["kv_b_proj"] = Linear.specs(r, n * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                          ("latent", "heads"), bias=False, dtype=dtype)
        specs["o_proj"] = Linear.specs(n * cfg.v_head_dim, h, ("o_heads", "o_embed"), bias=bias,
                                       dtype=dtype)
        return specs

    @staticmethod
    def kv_pages(cfg) -> LatentPages:
        return LatentPages(width=cfg.kv_lora_rank + cfg.qk_rope_head_dim)

    def __init__(self, cfg, specs: dict, source, *, lora_scale: str | None = None):
        """lora_scale: --mla-lora-scale for a model with LoRA norm scales (cfg.mla_lora_scale;
        required then, refused otherwise)."""
        if bool(cfg.mla_lora_scale) != (lora_scale is not None):
            raise ValueError(f"{cfg.architecture}: mla_lora_scale={lora_scale!r} but the config "
                             f"{'has' if cfg.mla_lora_scale else 'has no'} MLA LoRA norm scales")
        if lora_scale is not None and lora_scale not in LORA_SCALES:
            raise ValueError(f"mla_lora_scale={lora_scale!r} is not one of {LORA_SCALES}")
        if lora_scale is not None and not cfg.q_lora_rank:
            raise ValueError(f"{cfg.architecture}: MLA LoRA norm scales need q_lora_rank > 0")
        self.lora_scale = lora_scale
        self.q_scale, self.kv_scale = lora_scales(cfg) if lora_scale else (None, None)
        self.num_heads, self.kv_lora_rank = cfg.num_attention_heads, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.scale = softmax_scale(cfg)
        self.rope_fn = apply_rope_interleaved if cfg.rope_interleave else apply_rope
        self.q_lora = "q_a_proj" in specs
        if self.q_lora:
            self.q_a_proj = Linear(specs["q_a_proj"], source)
            self.q_a_layernorm = RMSNorm(specs["q_a_layernorm"], source)
            self.q_b_proj = Linear(specs["q_b_proj"], source)
        else:
            self.q_proj = Linear(specs["q_proj"], source)
        self.kv_a_proj_with_mqa = Linear(specs["kv_a_proj_with_mqa"], source)
        self.kv_a_layernorm = RMSNorm(specs["kv_a_layernorm"], source)
        self.kv_b_proj = Linear(specs["kv_b_proj"], source)
        self.o_proj = Linear(specs["o_proj"], source)

    def __call__(self, kern, x, kv, *, page, slot, cos, sin, block_tables, token_req, positions,
                 dtype, tp=None):
        """x [T, H]; kv = (latent_pages,) [num_pages, page_size, kv_lora_rank + qk_rope_head_dim].
        Returns (output [T, H], the updated pages). As in `Attention`, every row's latent is
        written (padding rows out of bounds, dropped) before any row attends."""
        if tp is not None:
            raise ValueError("MLA attention has no tensor-parallel form (launch with --tp-size 1)")
        t, n, r = x.shape[0], self.num_heads, self.kv_lora_rank
        if self.q_lora:
            # q_a_proj and kv_a_proj_with_mqa read one x: one grouped GEMM, each its own bits.
            q_a, ckv = linears(kern, x, (self.q_a_proj, self.kv_a_proj_with_mqa), out_dtype=dtype)
            q_a = self._latent_norm(kern, self.q_a_layernorm, q_a, self.q_scale, dtype)
            q = self.q_b_proj(kern, q_a, out_dtype=dtype)
        else:
            q = self.q_proj(kern, x, out_dtype=dtype)
            ckv = self.kv_a_proj_with_mqa(kern, x, out_dtype=dtype)
        c = self._latent_norm(kern, self.kv_a_layernorm, ckv[:, :r], self.kv_scale, dtype)
        if self.lora_scale == "runtime":
            q, c = scaled(q, self.q_scale, dtype), scaled(c, self.kv_scale, dtype)
        q = q.reshape(t, n, self.nope + self.rope)
        q_nope, q_rope = q[..., :self.nope], self.rope_fn(q[..., self.nope:], cos, sin)
        k_rope = self.rope_fn(ckv[:, None, r:], cos, sin)[:, 0]
        (pages,) = kv
        latent = jnp.concatenate([c, k_rope], axis=-1).astype(pages.dtype)
        pages = pages.at[page, slot].set(latent, mode="drop", unique_indices=True)

        w_uk, w_uv = self.absorbed_weights()
        q_latent = jnp.stack([kern.gemm(q_nope[:, h], w_uk[h], None, out_dtype=dtype)
                              for h in range(n)], axis=1)  # [T, n, r]
        o_latent = kern.mla_attention(jnp.concatenate([q_latent, q_rope], axis=-1), pages,
                                      block_tables, token_req, positions, v_width=r,
                                      scale=self.scale)  # [T, n, r]
        o = jnp.concatenate([kern.gemm(o_latent[:, h], w_uv[h], None, out_dtype=dtype)
                             for h in range(n)], axis=-1)  # [T, n * v_head_dim]
        return self.o_proj(kern, o, out_dtype=dtype), (pages,)

    def _latent_norm(self, kern, norm, x, scale, dtype):
        """q_a_layernorm / kv_a_layernorm; under --mla-lora-scale folded, with the scale folded
        into the weight (module docstring)."""
        if self.lora_scale != "folded":
            return norm(kern, x, eps=LATENT_NORM_EPS)
        return kern.rmsnorm(x, scaled(norm.weight[...], scale, dtype), eps=LATENT_NORM_EPS)

    def absorbed_weights(self):
        """kv_b_proj split per head: W_UK [n, nope, r] (q_nope -> latent) and W_UV [n, r, v]
        (latent -> value), each laid out [K, N] for the gemm leaf."""
        w = self.kv_b_proj.weight[...].reshape(self.kv_lora_rank, self.num_heads,
                                               self.nope + self.v_dim)
        w_uk = jnp.transpose(w[..., :self.nope], (1, 2, 0))
        w_uv = jnp.transpose(w[..., self.nope:], (1, 0, 2))
        return w_uk, w_uv
