"""("attention", "paged") and ("attention", "dense_causal").

A query row attends to every context position ``c <= its position``. The fixed-order core
(``attend_fixed_order``) reduces that context in KV blocks of ``KV_BLOCK`` positions counted from
position 0, folded left to right, and skips blocks past the query's position exactly (a ``where``,
not an added zero). So a token scored in a 512-row prefill chunk, a 7-row chunk or as a decode step
gets the same bits: nothing depends on the number of rows, the number of pages gathered, or which
other requests share the step. Masked positions contribute exact zeros and unused page slots are
never multiplied into a sum (``where`` on the product, so garbage or NaN cannot leak in).

Arithmetic, per query row and head (f32 throughout, inputs widened from the model dtype):
  s_c = sum_d q_d * k_cd, d = 0..D-1 in order        (exact bf16 products)
  m   = max over valid c of s_c                       (exact: order-free)
  p_c = fixed_exp((s_c - m) * scale) for valid c, else 0  (the scale after the max: see below)
  l   = fold over blocks b of tree_sum(p in block b)
  o   = fold over blocks b of tree_sum(p_c * v_c in block b) (split_product), times 1 / l,
        rounded once.

Nothing here may round differently in another program (pallas_kernels/fixed_order.py): XLA
contracts ``s * scale - m`` into an FMA in some programs and not in others (on the CPU it did, at
one context length of a request and not at another), so the scale multiplies the difference and
feeds only the exponential; ``p * v`` is summed as exact partial products; the exponential is
``fixed_exp`` (XLA:CPU's exp gives other bits when a fusion is not vectorized: a 320-row step and a
1-row step of the same row differed); the normalisation is an explicit multiply by the reciprocal
(XLA rewrites ``o / l`` into it anyway).

``paged`` gathers each token's context from the KV pages; ``dense_causal`` takes contiguous K/V (the
trainer's layout, used by interop's twin). Both call the same core, so they agree bit for bit.

These are the CPU leaf's own bits, not the GPU leaf's (pallas_kernels/triton_attention.py): each
platform's engine and trainer twin run the same leaf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._twin import torch_twin
from pallas_kernels.fixed_order import fixed_exp, split_product, tree_sum
from pallas_kernels.registry import Priority, declare_family, register


def _paged_signature(q, kv, block_tables, token_req, positions, *, scale):
    """q[T, Hq, D], kv = (k_pages, v_pages) [pages, page, Hkv, D], tables int[R, P], rows int[T] -> [T, Hq, D]."""


def _dense_causal_signature(q, k, v, *, scale):
    """q[B, S, Hq, D], k/v [B, S, Hkv, D] -> [B, S, Hq, D]; query i attends to positions 0..i."""


declare_family("attention", "paged", _paged_signature)
declare_family("attention", "dense_causal", _dense_causal_signature)

KV_BLOCK = 16

_INVARIANT = dict(traits={"deterministic": True, "batch_invariant": True},
                  features={"batch_invariant"})


def _pad_context(k_ctx, v_ctx):
    c = k_ctx.shape[1]
    padded = -(-c // KV_BLOCK) * KV_BLOCK
    if padded != c:
        pad = [(0, 0), (0, padded - c), (0, 0), (0, 0)]
        k_ctx, v_ctx = jnp.pad(k_ctx, pad), jnp.pad(v_ctx, pad)
    return k_ctx, v_ctx


def attend_fixed_order(q, k_ctx, v_ctx, q_ctx, q_pos, *, scale):
    """q [T, Hq, D]; k_ctx [R, C, Hkv, D], v_ctx [R, C, Hkv, Dv] (context index = absolute
    position; Dv = D but for MLA's latent, pallas_kernels/mla_attention.py); q_ctx [T]: which
    context each query row reads; q_pos [T]: the row's position. -> [T, Hq, Dv]"""
    t, hq, d = q.shape
    dv = v_ctx.shape[-1]
    k_ctx, v_ctx = _pad_context(k_ctx, v_ctx)
    c, hkv = k_ctx.shape[1], k_ctx.shape[2]
    g = hq // hkv
    qf = q.astype(jnp.float32).reshape(t, hkv, g, d)
    kf = jnp.transpose(k_ctx.astype(jnp.float32), (0, 2, 3, 1))  # [R, Hkv, D, C]
    vf = jnp.transpose(v_ctx.astype(jnp.float32), (0, 2, 1, 3))  # [R, Hkv, C, D]

    def score_step(i, s):
        qd = lax.dynamic_index_in_dim(qf, i, axis=3, keepdims=False)  # [T, Hkv, G]
        kd = lax.dynamic_index_in_dim(kf, i, axis=2, keepdims=False)[q_ctx]  # [T, Hkv, C]
        return s + qd[..., None] * kd[:, :, None, :]

    s = lax.fori_loop(0, d, score_step, jnp.zeros((t, hkv, g, c), jnp.float32))
    valid = (jnp.arange(c)[None, :] <= q_pos[:, None])[:, None, None, :]  # [T, 1, 1, C]
    m = jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1, keepdims=True)
    p = jnp.where(valid, fixed_exp((s - m) * jnp.float32(scale)), 0.0)

    def block_step(b, carry):
        l_acc, o_acc = carry
        start = b * KV_BLOCK
        pb = lax.dynamic_slice_in_dim(p, start, KV_BLOCK, axis=3)  # [T, Hkv, G, B]
        vb = lax.dynamic_slice_in_dim(vf, start, KV_BLOCK, axis=2)[q_ctx]  # [T, Hkv, B, D]
        vmask = lax.dynamic_slice_in_dim(valid, start, KV_BLOCK, axis=3)[..., None]
        pv = jnp.where(vmask, split_product(pb[..., None], vb[:, :, None, :, :], v_ctx.dtype),
                       0.0)  # [T, Hkv, G, B, D]
        live = (start <= q_pos)[:, None, None]  # block holds at least one valid position
        l_new = jnp.where(live, l_acc + tree_sum(pb, axis=-1), l_acc)
        o_new = jnp.where(live[..., None], o_acc + tree_sum(pv, axis=-2), o_acc)
        return l_new, o_new

    l0 = jnp.zeros((t, hkv, g), jnp.float32)
    o0 = jnp.zeros((t, hkv, g, dv), jnp.float32)
    l, o = lax.fori_loop(0, c // KV_BLOCK, block_step, (l0, o0))
    return (o * (jnp.float32(1.0) / l)[..., None]).astype(q.dtype).reshape(t, hq, dv)


def attend_xla_native(q, k_ctx, v_ctx, q_ctx, q_pos, *, scale):
    """The same attention with XLA's own dot and reductions (auto mode; batch-variant)."""
    t, hq, d = q.shape
    c, hkv = k_ctx.shape[1], k_ctx.shape[2]
    g = hq // hkv
    qf = q.reshape(t, hkv, g, d)
    s = jnp.einsum("thgd,tchd->thgc", qf, k_ctx[q_ctx], preferred_element_type=jnp.float32)
    s = s * jnp.float32(scale)
    valid = (jnp.arange(c)[None, :] <= q_pos[:, None])[:, None, None, :]
    p = jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1)
    o = jnp.einsum("thgc,tchd->thgd", p, v_ctx[q_ctx].astype(jnp.float32))
    return o.astype(q.dtype).reshape(t, hq, v_ctx.shape[-1])


def _gather_pages(cache, block_tables):
    """cache [Np, ps, Hkv, D], block_tables [R, P] -> [R, P*ps, Hkv, D] in position order."""
    ctx = cache[block_tables]  # [R, P, ps, Hkv, D]
    r, p, ps, hkv, d = ctx.shape
    return ctx.reshape(r, p * ps, hkv, d)


def _paged(core):
    def paged_attention(q, kv, block_tables, token_req, positions, *, scale):
        """q [T, Hq, D]; kv = (k_pages, v_pages), each [Np, ps, Hkv, D] (the layer's K/V pages,
        jengine.models.kv_cache.KVPages); block_tables [R, P]; token_req, positions [T]."""
        k_cache, v_cache = kv
        k_ctx = _gather_pages(k_cache, block_tables)
        v_ctx = _gather_pages(v_cache, block_tables)
        return core(q, k_ctx, v_ctx, token_req, positions, scale=scale)

    return paged_attention


def _dense_causal(core):
    def dense_causal_attention(q, k, v, *, scale):
        """q [B, S, Hq, D], k/v [B, S, Hkv, D] -> [B, S, Hq, D]; query i attends to 0..i.
        (v may be narrower than q and k: HF's expanded MLA, v_head_dim < qk_head_dim.)"""
        b, s, hq, d = q.shape
        q_ctx = jnp.repeat(jnp.arange(b, dtype=jnp.int32), s)
        q_pos = jnp.tile(jnp.arange(s, dtype=jnp.int32), b)
        out = core(q.reshape(b * s, hq, d), k, v, q_ctx, q_pos, scale=scale)
        return out.reshape(b, s, hq, v.shape[-1])

    return dense_causal_attention


paged_fixed_order = register("attention", "paged", "fixed_order", formats={"bf16", "f32"},
                             hardware={"any"}, priority=Priority.PORTABLE,
                             **_INVARIANT)(_paged(attend_fixed_order))
paged_xla_native = register("attention", "paged", "xla_native", formats={"bf16", "f32"},
                            hardware={"any"}, priority=Priority.TUNED + 1,
                            traits={"batch_invariant": False})(_paged(attend_xla_native))
dense_causal_fixed_order = register("attention", "dense_causal", "fixed_order",
                                    formats={"bf16", "f32"}, hardware={"any"},
                                    priority=Priority.PORTABLE,
                                    **_INVARIANT)(_dense_causal(attend_fixed_order))
dense_causal_xla_native = register("attention", "dense_causal", "xla_native",
                                   formats={"bf16", "f32"}, hardware={"any"},
                                   priority=Priority.TUNED + 1,
                                   traits={"batch_invariant": False})(_dense_causal(attend_xla_native))

dense_causal_fixed_order_torch = torch_twin(dense_causal_fixed_order, static_argnames=("scale",))
