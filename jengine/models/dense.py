"""The dense decoder family: HF LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.

GQA attention with RoPE (default / llama3 / yarn), RMSNorm, SwiGLU, Qwen2's qkv bias, Qwen3's
per-head q/k norm, tied or untied embeddings, and split input/output vocabularies.

The model sees a flat ragged batch of token rows (jengine/engine/batch.py) and knows nothing about
requests or scheduling. Every reduction goes through a planned leaf (`ModelKernels`), chosen once at
construction; the glue between leaves is exact elementwise work in the model dtype (casts, adds,
multiplies, gathers), in the order HF's forward performs it, because that order is what the
trainer's bits follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels  # noqa: F401  (importing the package registers every in-tree leaf)
from jengine.engine.batch import NULL_PAGE
from jengine.models.rope import apply_rope, rope_tables
from pallas_kernels.registry import KernelPlan, plan


@dataclass(frozen=True)
class ModelKernels:
    """The frozen leaf choices of one model, made once at construction."""

    gemm: KernelPlan
    rmsnorm: KernelPlan
    add_rmsnorm: KernelPlan
    silu: KernelPlan
    attention: KernelPlan

    @classmethod
    def plan_for(cls, *, dtype, hardware: str, features=frozenset(),
                 head_dim: int | None = None) -> "ModelKernels":
        """head_dim: the attention geometry, for leaves that constrain it (the Triton attention)."""
        fmt = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float32): "f32"}[jnp.dtype(dtype)]
        kw = dict(formats={fmt}, hardware=hardware, features=features)
        attention_geometry = {} if head_dim is None else {"head_dim": head_dim}
        return cls(
            gemm=plan("linear", "gemm", **kw),
            rmsnorm=plan("norm", "rmsnorm", **kw),
            add_rmsnorm=plan("norm", "add_rmsnorm", **kw),
            silu=plan("activation", "silu", **kw),
            attention=plan("attention", "paged", geometry=attention_geometry, **kw),
        )

    def gemm_group(self, x, ws, biases=None, *, out_dtype):
        """Projections of one x (q/k/v, gate/up): the GEMM leaf's grouped form where it has one --
        one launch whose every output has the bits of its own gemm call -- else one call each."""
        # A wrapped plan (interop/bisect.py's recorder) has no leaf: one call each, each recorded.
        leaf = getattr(self.gemm, "leaf", None)
        grouped = getattr(leaf.fn, "grouped", None) if leaf is not None else None
        if grouped is not None:
            return grouped(x, ws, biases, out_dtype=out_dtype)
        return tuple(self.gemm(x, w, None if biases is None else biases[i], out_dtype=out_dtype)
                     for i, w in enumerate(ws))

    def describe(self) -> dict[str, str]:
        return {f: getattr(self, f).leaf.impl for f in self.__dataclass_fields__}


def _param(weights: dict, name: str, dtype, transpose: bool = False) -> nnx.Param:
    if name not in weights:
        raise KeyError(f"checkpoint is missing tensor {name!r}")
    arr = np.asarray(weights[name])
    if transpose:
        arr = arr.T
    return nnx.Param(jnp.asarray(arr).astype(dtype))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, weights: dict, index: int, dtype):
        p = f"model.layers.{index}."
        a = p + "self_attn."
        self.input_layernorm = _param(weights, p + "input_layernorm.weight", dtype)
        self.post_attention_layernorm = _param(weights, p + "post_attention_layernorm.weight", dtype)
        # Projections are stored [in, out] so a leaf computes x @ w.
        self.q_proj = _param(weights, a + "q_proj.weight", dtype, transpose=True)
        self.k_proj = _param(weights, a + "k_proj.weight", dtype, transpose=True)
        self.v_proj = _param(weights, a + "v_proj.weight", dtype, transpose=True)
        self.o_proj = _param(weights, a + "o_proj.weight", dtype, transpose=True)
        self.has_bias = bool(cfg.attention_bias)
        self.has_o_bias = bool(getattr(cfg, "attention_output_bias", False))
        if self.has_o_bias:
            self.o_bias = _param(weights, a + "o_proj.bias", dtype)
        if self.has_bias:
            self.q_bias = _param(weights, a + "q_proj.bias", dtype)
            self.k_bias = _param(weights, a + "k_proj.bias", dtype)
            self.v_bias = _param(weights, a + "v_proj.bias", dtype)
        self.qk_norm = bool(cfg.qk_norm)
        if self.qk_norm:
            self.q_norm = _param(weights, a + "q_norm.weight", dtype)
            self.k_norm = _param(weights, a + "k_norm.weight", dtype)
        m = p + "mlp."
        self.gate_proj = _param(weights, m + "gate_proj.weight", dtype, transpose=True)
        self.up_proj = _param(weights, m + "up_proj.weight", dtype, transpose=True)
        self.down_proj = _param(weights, m + "down_proj.weight", dtype, transpose=True)


class DenseDecoder(nnx.Module):
    """Weights and the forward of one dense decoder. Built from HF-named numpy weights."""

    def __init__(self, cfg, weights: dict, *, dtype, kernels: ModelKernels,
                 layer_boundary_norm: str = "unfused", rope_frequency_device: str = "device",
                 rope_ramp_device: str = "cpu"):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.kernels = kernels
        self.unfused_norm = layer_boundary_norm == "unfused"
        self.embed_tokens = _param(weights, "model.embed_tokens.weight", dtype)
        self.layers = nnx.List([DecoderLayer(cfg, weights, i, dtype)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = _param(weights, "model.norm.weight", dtype)
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            head = np.asarray(weights["model.embed_tokens.weight"])[: cfg.vocab_size]
        else:
            head = np.asarray(weights["lm_head.weight"])
        if head.shape[0] != cfg.vocab_size:
            raise ValueError(f"LM head has {head.shape[0]} rows but vocab_size={cfg.vocab_size}")
        self.lm_head = nnx.Param(jnp.asarray(head.T).astype(dtype))  # [H, V]
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                               cfg.max_position_embeddings, self.dtype,
                               frequency_device=rope_frequency_device, ramp_device=rope_ramp_device)
        self.rope_cos = nnx.Variable(cos)
        self.rope_sin = nnx.Variable(sin)

    # -- forward ----------------------------------------------------------------------------------
    def __call__(self, input_ids, positions, token_req, block_tables, k_cache, v_cache):
        """One step over T token rows.

        input_ids, positions, token_req [T]; block_tables [R, P] (each request's pages);
        k_cache, v_cache: one [num_pages, page_size, Hkv, D] array per layer. Returns the
        final-norm hidden states [T, H] and the updated caches, as tuples (every row's K/V written
        before any row attends).
        """
        cfg, kern = self.cfg, self.kernels
        page_size = k_cache[0].shape[1]
        page = block_tables[token_req, positions // page_size]
        # Padding rows (and only they) map to the null page; their writes are sent out of bounds
        # and dropped, so every written (page, slot) is unique. Declared unique, the KV scatter is
        # a plain in-place write even under --xla_gpu_deterministic_ops, which otherwise sorts
        # the indices (measured on the H200: 1.3 ms of a 14.5 ms decode step at batch 64).
        page = jnp.where(page == NULL_PAGE, k_cache[0].shape[0], page)
        slot = positions % page_size
        cos = self.rope_cos[...][positions]
        sin = self.rope_sin[...][positions]
        eps = cfg.rms_norm_eps

        h = self.embed_tokens[...][input_ids]
        residual = None
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            if self.unfused_norm or residual is None:
                if residual is not None:
                    h = residual + h  # the trainer's bf16 residual, materialised
                residual = h
                x = kern.rmsnorm(h, layer.input_layernorm[...], eps=eps)
            else:
                x, residual = kern.add_rmsnorm(h, residual, layer.input_layernorm[...], eps=eps)
            attn, kc, vc = self._attention(layer, x, positions, token_req, block_tables, page, slot,
                                           cos, sin,
                                           k_cache[i], v_cache[i])
            new_k.append(kc)
            new_v.append(vc)
            if self.unfused_norm:
                h = residual + attn
                residual = h
                x = kern.rmsnorm(h, layer.post_attention_layernorm[...], eps=eps)
            else:
                x, residual = kern.add_rmsnorm(attn, residual, layer.post_attention_layernorm[...],
                                               eps=eps)
            h = self._mlp(layer, x)
        if self.unfused_norm:
            out = kern.rmsnorm(residual + h, self.norm[...], eps=eps)
        else:
            out, _ = kern.add_rmsnorm(h, residual, self.norm[...], eps=eps)
        return out, tuple(new_k), tuple(new_v)

    def _linear(self, x, w, bias=None):
        return self.kernels.gemm(x, w[...], None if bias is None else bias[...], out_dtype=self.dtype)

    def _linears(self, x, ws, biases=None):
        """Several projections of x; each output's bits are those of its own _linear."""
        return self.kernels.gemm_group(x, tuple(w[...] for w in ws),
                                       None if biases is None else tuple(b[...] for b in biases),
                                       out_dtype=self.dtype)

    def _attention(self, layer, x, positions, token_req, block_tables, page, slot, cos, sin,
                   k_cache, v_cache):
        cfg, kern = self.cfg, self.kernels
        t = x.shape[0]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        biases = (layer.q_bias, layer.k_bias, layer.v_bias) if layer.has_bias else None
        q, k, v = self._linears(x, (layer.q_proj, layer.k_proj, layer.v_proj), biases)
        q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        if layer.qk_norm:
            q = kern.rmsnorm(q.reshape(t * hq, d), layer.q_norm[...], eps=cfg.rms_norm_eps).reshape(t, hq, d)
            k = kern.rmsnorm(k.reshape(t * hkv, d), layer.k_norm[...], eps=cfg.rms_norm_eps).reshape(t, hkv, d)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_cache = k_cache.at[page, slot].set(k.astype(k_cache.dtype), mode="drop", unique_indices=True)
        v_cache = v_cache.at[page, slot].set(v.astype(v_cache.dtype), mode="drop", unique_indices=True)
        o = kern.attention(q, k_cache, v_cache, block_tables, token_req, positions, scale=d ** -0.5)
        o_bias = layer.o_bias if layer.has_o_bias else None
        return self._linear(o.reshape(t, hq * d), layer.o_proj, o_bias), k_cache, v_cache

    def _mlp(self, layer, x):
        gate, up = self._linears(x, (layer.gate_proj, layer.up_proj))
        return self._linear(self.kernels.silu(gate) * up, layer.down_proj)

    def compute_logits(self, hidden):
        """LM head: [n, H] -> [n, V] in the model dtype, widened to f32 (an exact conversion)."""
        return self._linear(hidden, self.lm_head).astype(jnp.float32)
