"""Gradients under trainer mode: the forward is the twin (the engine's bits), the backward is torch.

A trainer differentiates the same forward whose logprobs it compares with the engine's, so every
twin trainer mode calls must carry a backward. Only the forward is promised bitwise; a backward may
use any accurate arithmetic, so each one here is the textbook formula in plain torch, in f32.

Trainer mode reaches the twins two ways, and each way gets its backward differently:

* The aten overrides (mm, addmm, bmm, mean.dim, rsqrt, silu, cos, sin, pow, exp, log) sit at the
  CPU/CUDA *backend* dispatch key, below autograd. Autograd records each call with torch's own
  derivative formula (derivatives.yaml: ``MmBackward0``, ``RsqrtBackward0``, ...) before handing it
  down to the twin, so those ops need nothing here. The formulas' own ops run under trainer mode
  too (a backward ``mm`` is the fixed-order GEMM twin): accurate, just not the fast kernels.
* Four twins are called from Python, above the dispatcher, where autograd cannot see into them:
  the dense-causal attention (selected through transformers' ``AttentionInterface``), the MLA
  attention (interop/trainer_mla.py), the blockwise
  log-sum-exp of the trainer's logprob (interop/trainer_logprobs.py) and a MoE router's top-k (the
  router module's forward, interop/trainer_mode.py). A twin returns a fresh tensor from JAX, which
  would silently cut the graph; the ``torch.autograd.Function``s below wrap them.
"""

from __future__ import annotations

from typing import Callable

import torch


def causal_attention_backward(q, k, v, grad_out, scale: float):
    """(dq, dk, dv) of softmax(q k^T * scale, causal) v, in f32, cast to the inputs' dtypes.

    q [B, S, Hq, D], k/v [B, S, Hkv, D], grad_out [B, S, Hq, D]; query head h reads KV head
    h // (Hq // Hkv), as the engine's leaf and HF's ``repeat_kv`` do.
    """
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    qf = q.float().transpose(1, 2)  # [B, Hq, S, D]
    kf = k.float().transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    do = grad_out.float().transpose(1, 2)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax((qf @ kf.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf")), dim=-1)
    dp = do @ vf.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # softmax's Jacobian applied to dp
    dq = ds @ kf * scale
    dk = ds.transpose(-1, -2) @ qf * scale
    dv = p.transpose(-1, -2) @ do

    def per_kv_head(t):  # [B, Hq, S, D] -> [B, S, Hkv, D]: a KV head's grads sum over its group
        return t.reshape(b, hkv, group, s, d).sum(2).transpose(1, 2)

    return dq.transpose(1, 2).to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


class _TwinAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, twin, scale):
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return twin(q, k, v, scale=scale)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        return (*causal_attention_backward(q, k, v, grad_out, ctx.scale), None, None)


def twin_attention(twin: Callable, q, k, v, *, scale: float):
    """``twin(q, k, v, scale=scale)`` (the dense-causal attention leaf's twin: q [B, S, Hq, D],
    k/v [B, S, Hkv, D]) with a backward, so gradients reach q, k and v."""
    return _TwinAttention.apply(q, k, v, twin, scale)


class _TwinMLAAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, latent, twin, v_width, scale):
        ctx.save_for_backward(q, latent)
        ctx.v_width, ctx.scale = v_width, scale
        return twin(q, latent, v_width=v_width, scale=scale)

    @staticmethod
    def backward(ctx, grad_out):
        # MQA with one KV head whose key is the latent and whose value is its first v_width
        # columns: the dense backward with value = the whole latent and zero gradient on the
        # columns the output does not carry; the latent's gradient is its key's plus its value's.
        q, latent = ctx.saved_tensors
        kv = latent[:, :, None, :]
        pad = grad_out.new_zeros(*grad_out.shape[:-1], latent.shape[-1] - ctx.v_width)
        dq, dk, dv = causal_attention_backward(q, kv, kv, torch.cat([grad_out, pad], -1),
                                               ctx.scale)
        return dq, (dk + dv)[:, :, 0], None, None, None


def twin_mla_attention(twin: Callable, q, latent, *, v_width: int, scale: float):
    """``twin(q, latent, v_width=, scale=)`` (the MLA dense-causal leaf's twin: q [B, S, H, W],
    latent [B, S, W] -> [B, S, H, v_width]) with a backward to q and the latent."""
    return _TwinMLAAttention.apply(q, latent, twin, v_width, scale)


def fold_partials(partials):
    """Per-block sums [R, blocks] -> [R], folded left to right (the trainer's rank order)."""
    total = partials[:, 0]
    for j in range(1, partials.shape[1]):
        total = total + partials[:, j]
    return total


class _BlockwiseLogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shifted, block_sumexp, log, block_size):
        total = fold_partials(block_sumexp(shifted.contiguous(), block_size=block_size))
        log_s = log(total.contiguous())
        ctx.save_for_backward(shifted)
        return log_s

    @staticmethod
    def backward(ctx, grad_log_s):
        (shifted,) = ctx.saved_tensors
        # d log(sum_j exp(x_j)) / d x_i = softmax(x)_i; the block split does not change the sum.
        return grad_log_s[:, None] * torch.softmax(shifted, dim=-1), None, None, None


def blockwise_log_sum_exp(shifted, *, block_sumexp: Callable, log: Callable, block_size: int):
    """f32[R] log(S) of f32[R, V] ``shifted`` logits: S = ``block_sumexp``'s per-block sums of exp
    folded left to right, then ``log`` (the twins' bits); backward: the softmax of ``shifted``."""
    return _BlockwiseLogSumExp.apply(shifted, block_sumexp, log, block_size)


class _TwinRouterTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, twin, k, norm_topk_prob):
        ids, weights = twin(logits.float().contiguous(), k=k, norm_topk_prob=norm_topk_prob)
        ids = ids.long()
        ctx.save_for_backward(logits, ids, weights)
        ctx.norm_topk_prob = norm_topk_prob
        ctx.mark_non_differentiable(ids)
        return ids, weights

    @staticmethod
    def backward(ctx, _grad_ids, grad_weights):
        logits, ids, weights = ctx.saved_tensors
        p = torch.softmax(logits.float(), dim=-1)
        grad_selected = grad_weights.float()
        if ctx.norm_topk_prob:  # w = s / sum(s): dL/ds_j = (g_j - sum_i g_i w_i) / sum(s)
            selected = p.gather(-1, ids)
            grad_selected = (grad_selected - (grad_selected * weights).sum(-1, keepdim=True)) \
                / selected.sum(-1, keepdim=True)
        grad_p = torch.zeros_like(p).scatter_add_(-1, ids, grad_selected)
        grad_logits = p * (grad_p - (grad_p * p).sum(-1, keepdim=True))  # softmax's Jacobian
        return grad_logits.to(logits.dtype), None, None, None


def twin_router_topk(twin: Callable, logits, *, k: int, norm_topk_prob: bool):
    """``twin(logits.float(), k=k, norm_topk_prob=...)`` (the ("moe", "router_topk") leaf's twin)
    -> (expert ids int64[T, k], routing weights f32[T, k]), with a backward to the logits through
    the softmax and the normalisation (the selection itself has no gradient)."""
    return _TwinRouterTopK.apply(logits, twin, k, norm_topk_prob)


class _TwinRouterGroupedTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, twin, static):
        ids, weights = twin(logits.float().contiguous(), bias.float().contiguous(), **static)
        ids = ids.long()
        ctx.save_for_backward(logits, ids)
        ctx.static = static
        ctx.mark_non_differentiable(ids)
        return ids, weights

    @staticmethod
    def backward(ctx, _grad_ids, grad_weights):
        logits, ids = ctx.saved_tensors
        static = ctx.static
        x = logits.float()
        scores = torch.sigmoid(x) if static["score"] == "sigmoid" else torch.softmax(x, dim=-1)
        selected = scores.gather(-1, ids)
        g = grad_weights.float() * static["routed_scaling_factor"]
        if static["norm_topk_prob"]:  # w = s / sum(s): dL/ds_j = (g_j - sum_i g_i w_i) / sum(s)
            total = selected.sum(-1, keepdim=True)
            g = (g - (g * selected / total).sum(-1, keepdim=True)) / total
        grad_s = torch.zeros_like(scores).scatter_add_(-1, ids, g)
        if static["score"] == "sigmoid":
            grad_logits = grad_s * scores * (1 - scores)
        else:
            grad_logits = scores * (grad_s - (grad_s * scores).sum(-1, keepdim=True))
        return grad_logits.to(logits.dtype), None, None, None


def twin_router_grouped_topk(twin: Callable, logits, bias, **static):
    """``twin(logits.float(), bias.float(), **static)`` (the ("moe", "router_grouped_topk") leaf's
    twin) -> (expert ids int64[T, k], routing weights f32[T, k]), with a backward to the logits
    through the scores, the normalisation and the scale (the bias only chooses: no gradient)."""
    return _TwinRouterGroupedTopK.apply(logits, bias, twin, static)
