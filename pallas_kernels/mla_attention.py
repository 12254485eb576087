"""("attention", "mla_paged") and ("attention", "mla_dense_causal"): absorbed multi-head latent
attention (DeepSeek-V2/V3's MLA) over one latent vector per position.

The KV cache holds, per position, ``latent = concat(c, k_rope)`` of width W = kv_lora_rank +
qk_rope_head_dim (jengine.models.kv_cache.LatentPages): ``c`` the normed compressed KV, ``k_rope``
the one rotary key every head shares. With W_UK absorbed into the query (jengine/models/layers/mla.py
computes ``q = concat(q_nope W_UK, q_rope)`` per head), every head scores the whole latent and
reads back ``c``:

  score_hc = q_h . latent_c = q_latent_h . c_c + q_rope_h . k_rope_c
  out_h    = sum_c softmax(score_h * scale)_c  c_c          -> [v_width = kv_lora_rank]

That is multi-query attention with one KV head whose key is the latent and whose value is its first
``v_width`` columns, so both leaves run the dense attention cores (pallas_kernels/attention.py) on
that view: the fixed-order core's KV blocks from position 0, its exact-zero masking and its
``fixed_exp``, so a token's bits do not depend on the batch, the chunking, or whether it was
prefilled or decoded. W_UV (latent -> value head) is not in this leaf: the layer applies it as its
own GEMM after the output is rounded, the spec's separate rounding boundary.

``mla_paged`` gathers each row's latent from the pages; ``mla_dense_causal`` takes the trainer's
contiguous latents (interop/trainer_mla.py calls its torch twin). Both call the same core, so they
agree bit for bit. These are the CPU's bits; on a GPU the rl-bitwise plan and trainer mode's twin
table pick the Triton form (pallas_kernels/triton_mla_attention.py: same claims, its own bits).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._twin import torch_twin
from pallas_kernels.attention import attend_fixed_order, attend_xla_native
from pallas_kernels.registry import Priority, declare_family, register


def _mla_paged_signature(q, latent_pages, block_tables, token_req, positions, *, v_width, scale):
    """q[T, H, W], latent_pages [pages, page, W], tables int[R, P], rows int[T] -> [T, H, v_width]."""


def _mla_dense_causal_signature(q, latent, *, v_width, scale):
    """q[B, S, H, W], latent [B, S, W] -> [B, S, H, v_width]; query i attends to positions 0..i."""


declare_family("attention", "mla_paged", _mla_paged_signature)
declare_family("attention", "mla_dense_causal", _mla_dense_causal_signature)

_INVARIANT = dict(traits={"deterministic": True, "batch_invariant": True},
                  features={"batch_invariant"})


def _as_one_kv_head(core):
    """A dense attention core on the latent: key = the whole latent, value = its first v_width."""
    def attend_latent(q, latent_ctx, q_ctx, q_pos, *, v_width, scale):
        """q [T, H, W]; latent_ctx [R, C, W] (context index = absolute position)."""
        k = latent_ctx[:, :, None, :]
        return core(q, k, k[..., :v_width], q_ctx, q_pos, scale=scale)

    return attend_latent


def _paged(core):
    attend_latent = _as_one_kv_head(core)

    def mla_paged_attention(q, latent_pages, block_tables, token_req, positions, *, v_width,
                            scale):
        """q [T, H, W]; latent_pages [Np, ps, W]; block_tables [R, P]; token_req, positions [T]."""
        ctx = latent_pages[block_tables]  # [R, P, ps, W], in position order
        r, p, ps, w = ctx.shape
        return attend_latent(q, ctx.reshape(r, p * ps, w), token_req, positions,
                             v_width=v_width, scale=scale)

    return mla_paged_attention


def _dense_causal(core):
    attend_latent = _as_one_kv_head(core)

    def mla_dense_causal_attention(q, latent, *, v_width, scale):
        """q [B, S, H, W], latent [B, S, W] -> [B, S, H, v_width]; query i attends to 0..i."""
        b, s, h, w = q.shape
        q_ctx = jnp.repeat(jnp.arange(b, dtype=jnp.int32), s)
        q_pos = jnp.tile(jnp.arange(s, dtype=jnp.int32), b)
        out = attend_latent(q.reshape(b * s, h, w), latent, q_ctx, q_pos, v_width=v_width,
                            scale=scale)
        return out.reshape(b, s, h, v_width)

    return mla_dense_causal_attention


_PORTABLE = dict(formats={"bf16", "f32"}, hardware={"any"}, priority=Priority.PORTABLE, **_INVARIANT)
_NATIVE = dict(formats={"bf16", "f32"}, hardware={"any"}, priority=Priority.TUNED + 1,
               traits={"batch_invariant": False})

mla_paged_fixed_order = register("attention", "mla_paged", "fixed_order",
                                 **_PORTABLE)(_paged(attend_fixed_order))
mla_paged_xla_native = register("attention", "mla_paged", "xla_native",
                                **_NATIVE)(_paged(attend_xla_native))
mla_dense_causal_fixed_order = register("attention", "mla_dense_causal", "fixed_order",
                                        **_PORTABLE)(_dense_causal(attend_fixed_order))
mla_dense_causal_xla_native = register("attention", "mla_dense_causal", "xla_native",
                                       **_NATIVE)(_dense_causal(attend_xla_native))

mla_dense_causal_fixed_order_torch = torch_twin(mla_dense_causal_fixed_order,
                                                static_argnames=("v_width", "scale"))
