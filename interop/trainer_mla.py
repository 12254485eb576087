"""Trainer mode's multi-head latent attention: HF's `DeepseekV3Attention.forward` replaced by the
engine's absorbed computation (jengine/models/layers/mla.py), op for op, in torch ops that trainer
mode routes to the twins.

HF runs MLA non-absorbed: it expands the latent into per-head keys (c W_UK, concatenated with the
shared rotary key) and values (c W_UV), attends over those, and rounds the expanded tensors and the
attention output. The engine never expands: it absorbs W_UK into the query, attends over the
cached latent with the ("attention", "mla_paged") leaf and applies W_UV after it. Same function,
other roundings (docs/models.md records how far apart they land). So trainer mode gives HF's
module the engine's forward:

  q, latent projections and norms   HF's own submodules (F.linear -> the GEMM twin; the RMSNorm's
                                    mean / rsqrt -> their twins), HF's rope functions (interleaved
                                    or not), elementwise in the model dtype as the engine runs them
  q_latent_h = q_nope_h @ W_UK_h    one mm per head -> the GEMM twin (the engine: one gemm call
                                    per head, rounded to the model dtype)
  attention                         the ("attention", "mla_dense_causal") leaf's twin: the paged
                                    leaf's core on contiguous latents, with HF's own `scaling`
                                    (on a GPU the Triton MLA kernels launched from torch, as the
                                    twin table plans them)
  out_h = out_latent_h @ W_UV_h     one mm per head -> the GEMM twin; then HF's o_proj

LongCat-Flash's `LongcatFlashMLA` runs the same forward with its LoRA norm scales where HF puts
them: q times mla_scale_q_lora after q_b_proj, the latent times mla_scale_kv_lora after
kv_a_layernorm (a bf16 tensor times a Python float: an f32 product rounded once), which is the
engine's `--mla-lora-scale runtime` (what rl-bitwise pins).

Every call is a plain torch op or an autograd-wrapped twin (interop/twin_autograd.py), so a loss
still differentiates it. Scope as trainer mode's: whole unpadded causal sequences, no KV cache
reuse (a cache is filled as HF fills it, but a forward over a non-empty cache is refused).
"""

from __future__ import annotations

import functools

import torch

from interop.twin_autograd import twin_mla_attention

# HF attention modules (by class name) that run MLA with DeepseekV3Attention's attributes
# (q_lora_rank, q_a_proj / q_a_layernorm / q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
# kv_b_proj, o_proj, scaling, config.rope_interleave).
# LongcatFlashMLA adds the LoRA norm scales (mla_scale_q_lora, mla_scale_kv_lora) and always
# interleaves its rotary pairs (its config has no rope_interleave).
MLA_ATTENTION_MODULES = ("DeepseekV3Attention", "LongcatFlashMLA")


def route_mla_attention(mode, model, restore: list, unset) -> int:
    """Give every `MLA_ATTENTION_MODULES` module of `model` the absorbed forward (an instance
    `forward`, recorded in `restore` as (module, "forward", unset) so leaving removes it)."""
    routed = 0
    for module in model.modules():
        if type(module).__name__ in MLA_ATTENTION_MODULES and "forward" not in vars(module):
            module.forward = functools.partial(absorbed_forward, mode, module)
            restore.append((module, "forward", unset))
            routed += 1
    return routed


def _rope(attn):
    """HF's own rotary functions, from the module's modeling file (interleaved pairs or halves)."""
    import sys

    modeling = sys.modules[type(attn).__module__]
    if getattr(attn.config, "rope_interleave", True):
        return modeling.apply_rotary_pos_emb_interleave
    return modeling.apply_rotary_pos_emb


def absorbed_forward(mode, attn, hidden_states, position_embeddings, attention_mask, cache=None,
                     **kwargs):
    """DeepseekV3Attention.forward's contract: hidden [B, S, H] -> (output [B, S, H], None)."""
    from interop.trainer_mode import _check_causal_mask

    b, s, _ = hidden_states.shape
    n, r = attn.num_heads, attn.kv_lora_rank
    nope, rope, v = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    if attn.q_lora_rank is None:
        q = attn.q_proj(hidden_states)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q = q.view(b, s, n, nope + rope).transpose(1, 2)  # [B, n, S, qk], as HF lays it out
    q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
    c, k_rot = torch.split(attn.kv_a_proj_with_mqa(hidden_states), [r, rope], dim=-1)
    c = attn.kv_a_layernorm(c)
    if hasattr(attn, "mla_scale_q_lora"):  # LongCat: HF's runtime LoRA scales, in the model dtype
        q_nope, q_rot = q_nope * attn.mla_scale_q_lora, q_rot * attn.mla_scale_q_lora
        c = c * attn.mla_scale_kv_lora      # the latent, not the rotary key
    cos, sin = position_embeddings
    q_rot, k_rot = _rope(attn)(q_rot, k_rot.view(b, 1, s, rope), cos, sin)
    if cache is not None:
        if cache.get_seq_length(attn.layer_idx):
            raise ValueError("trainer mode MLA needs the whole sequence at once: this forward "
                             f"continues a cache of {cache.get_seq_length(attn.layer_idx)} tokens")
        cache.update(c.view(b, 1, s, r), k_rot, attn.layer_idx)
    _check_causal_mask(attention_mask, s)

    w = attn.kv_b_proj.weight.view(n, nope + v, r)  # per head: W_UK^T rows, then W_UV^T rows
    q_latent = torch.stack([torch.matmul(q_nope[:, h].reshape(b * s, nope), w[h, :nope])
                            for h in range(n)], dim=1).view(b, s, n, r)
    query = torch.cat([q_latent, q_rot.transpose(1, 2)], dim=-1)  # [B, S, n, r + rope]
    latent = torch.cat([c, k_rot.view(b, s, rope)], dim=-1)  # [B, S, r + rope]: the cached page
    out_latent = twin_mla_attention(mode.table.mla_attention, query, latent, v_width=r,
                                    scale=float(attn.scaling))  # [B, S, n, r]
    mode.routed["mla_attention"] += 1
    out = torch.cat([torch.matmul(out_latent[:, :, h].reshape(b * s, r), w[h, nope:].t())
                     for h in range(n)], dim=-1)  # [B * S, n * v]
    return attn.o_proj(out.view(b, s, n * v)), None
