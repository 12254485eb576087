"""The dense decoder body that the Llama, Qwen2 and Qwen3 families share, and their kernel plans.

GQA attention with RoPE (default / llama3 / yarn), RMSNorm, SwiGLU, optional qkv and o_proj
biases, optional per-head q/k norm, tied or untied embeddings, and split input/output vocabularies.
What differs between the families is their config (jengine/models/{llama,qwen2,qwen3}.py).

The model sees a flat ragged batch of token rows (jengine/engine/batch.py) and knows nothing about
requests or scheduling. Every reduction goes through a planned leaf (`ModelKernels`), chosen once at
construction; the glue between leaves is exact elementwise work in the model dtype (casts, adds,
multiplies, gathers), in the order HF's forward performs it, because that order is what the
trainer's bits follow.

Parameters are declared by the layers (`param_specs`); a weight source fills them (a checkpoint
reader, or random values for the bench), so the model never sees a tensor name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax.numpy as jnp
from flax import nnx

import pallas_kernels  # noqa: F401  (importing the package registers every in-tree leaf)
from jengine.models.kv_cache import NULL_PAGE, KVCacheSpec
from jengine.models.layers.attention import Attention
from jengine.models.layers.embedding import Embedding
from jengine.models.layers.lm_head import LMHead
from jengine.models.layers.linear import PendingProjection
from jengine.models.layers.mlp import SwiGLU
from jengine.models.layers.norm import RMSNorm
from jengine.models.layers.param import ParamSpec
from jengine.models.layers.rope import rope_tables
from pallas_kernels import gemm_epilogues, rope_attention
from pallas_kernels.registry import KernelPlan, plan


@dataclass(frozen=True)
class ModelKernels:
    """The dense families' kernel-plan set: the frozen leaf choices of one model."""

    gemm: KernelPlan
    # Projections of one x (q/k/v, gate/up): one launch where the leaf has a grouped form, and
    # every output keeps the bits of its own gemm call (pallas_kernels/gemm.py).
    gemm_group: KernelPlan
    rmsnorm: KernelPlan
    add_rmsnorm: KernelPlan
    silu: KernelPlan
    attention: KernelPlan
    # RoPE on q and k, and the K/V page write: one Triton launch on a GPU, XLA's four kernels
    # elsewhere (pallas_kernels/rope_write.py)
    rope_write: KernelPlan
    # Experimental, planned only when JENGINE_GEMM_EPILOGUES asks (pallas_kernels/
    # gemm_epilogues.py): o_proj / down_proj with the layer boundary after it, and gate/up with
    # SwiGLU, each one leaf that gives the bits of the separate leaves above. None: the body
    # calls those.
    gemm_add_rmsnorm: KernelPlan | None = field(default=None, kw_only=True)
    gemm_swiglu: KernelPlan | None = field(default=None, kw_only=True)
    # rope_write and attention as one leaf giving their bits (on a GPU one launch at decode
    # steps of <= 16 rows and 2048 positions; pallas_kernels/rope_attention.py). None
    # (JENGINE_ATTENTION_ROPE=off, or no leaf composes the two planned): the layer calls the two.
    rope_paged: KernelPlan | None = field(default=None, kw_only=True)

    @classmethod
    def plan_for(cls, *, dtype, hardware: str, features=frozenset(),
                 head_dim: int | None = None) -> "ModelKernels":
        """head_dim: the attention geometry, for leaves that constrain it (the Triton attention)."""
        fmt = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float32): "f32"}[jnp.dtype(dtype)]
        kw = dict(formats={fmt}, hardware=hardware, features=features)
        attention_geometry = {} if head_dim is None else {"head_dim": head_dim}
        plans = dict(
            gemm=plan("linear", "gemm", **kw),
            gemm_group=plan("linear", "gemm_group", **kw),
            rmsnorm=plan("norm", "rmsnorm", **kw),
            add_rmsnorm=plan("norm", "add_rmsnorm", **kw),
            silu=plan("activation", "silu", **kw),
            attention=plan("attention", "paged", geometry=attention_geometry, **kw),
            rope_write=plan("attention", "rope_write", geometry=attention_geometry, **kw),
        )
        return cls(**plans, **gemm_epilogues.plan_fused(plans, **kw),
                   **rope_attention.plan_fused(plans, geometry=attention_geometry, **kw))

    def describe(self) -> dict[str, str]:
        return {f: None if getattr(self, f) is None else getattr(self, f).leaf.impl
                for f in self.__dataclass_fields__}


def dense_mlp(cfg, layer: int):
    """The MLP class of decoder layer `layer`: SwiGLU in every dense family. A body whose layers
    differ (Qwen3-MoE's experts, jengine/models/moe_decoder.py) passes its own choice; an MLP
    class has `specs(cfg, *, dtype)`, `__init__(cfg, specs, source)` and
    `__call__(kern, x, *, dtype, tp)`."""
    return SwiGLU


class DecoderLayer(nnx.Module):
    """attention: the attention class (GQA `Attention`; MLA's `MLAttention`,
    jengine/models/layers/mla.py); it takes the call `Attention.__call__` takes."""

    @staticmethod
    def specs(cfg, *, dtype, mlp=SwiGLU, attention=Attention) -> dict[str, dict]:
        return {"input_layernorm": RMSNorm.specs(cfg.hidden_size, "embed", dtype=dtype),
                "self_attn": attention.specs(cfg, dtype=dtype),
                "post_attention_layernorm": RMSNorm.specs(cfg.hidden_size, "embed", dtype=dtype),
                "mlp": mlp.specs(cfg, dtype=dtype)}

    def __init__(self, cfg, specs: dict, source, mlp=SwiGLU, attention=Attention):
        self.input_layernorm = RMSNorm(specs["input_layernorm"], source)
        self.self_attn = attention(cfg, specs["self_attn"], source)
        self.post_attention_layernorm = RMSNorm(specs["post_attention_layernorm"], source)
        self.mlp = mlp(cfg, specs["mlp"], source)


def param_specs(cfg, *, dtype, checkpoint_name: Callable[[str], str],
                mlp_for=dense_mlp, attention=Attention) -> dict[str, ParamSpec]:
    """Every parameter of a dense decoder, by path ("layers.0.self_attn.q_proj.weight"), with its
    checkpoint tensor named by the family's `checkpoint_name(path)`. Nothing is loaded.
    mlp_for(cfg, layer): each layer's MLP class (`dense_mlp`); attention: every layer's attention
    class."""
    tree = {"embed_tokens": Embedding.specs(cfg, dtype=dtype),
            "layers": {str(i): DecoderLayer.specs(cfg, dtype=dtype, mlp=mlp_for(cfg, i),
                                                  attention=attention)
                       for i in range(cfg.num_hidden_layers)},
            "norm": RMSNorm.specs(cfg.hidden_size, "embed", dtype=dtype),
            "lm_head": LMHead.specs(cfg, dtype=dtype)}
    return {path: spec.named(checkpoint_name(path)) for path, spec in _flatten(tree)}


def kv_cache_spec(cfg) -> KVCacheSpec:
    return KVCacheSpec(layers=(Attention.kv_pages(cfg),) * cfg.num_hidden_layers)


class DenseDecoder(nnx.Module):
    """Weights and the forward of one dense decoder, its parameters filled from `source`."""

    mlp_for = staticmethod(dense_mlp)  # each layer's MLP class; a subclass may choose per layer
    attention = Attention  # every layer's attention class (MLA's body sets its own)

    def __init__(self, cfg, specs: dict[str, ParamSpec], source, *, dtype, kernels: ModelKernels,
                 layer_boundary_norm: str = "unfused", rope_frequency_device: str = "device",
                 rope_ramp_device: str = "cpu", tensor_parallel=None):
        """tensor_parallel: a sharding.tensor_parallel.TensorParallel when the forward runs as
        one rank's shard inside shard_map (the runner's TP path), else None (one device)."""
        self.cfg = cfg
        self.tp = tensor_parallel
        self.dtype = jnp.dtype(dtype)
        self.kernels = kernels
        self.unfused_norm = layer_boundary_norm == "unfused"
        self.param_paths = tuple(specs)
        tree = _nest(specs)
        self.embed_tokens = Embedding(tree["embed_tokens"], source)
        self.layers = nnx.List([self.make_layer(cfg, tree["layers"][str(i)], source, i)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(tree["norm"], source)
        self.lm_head = LMHead(tree["lm_head"], source)
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                               cfg.max_position_embeddings, self.dtype,
                               frequency_device=rope_frequency_device, ramp_device=rope_ramp_device)
        self.rope_cos = nnx.Variable(cos)
        self.rope_sin = nnx.Variable(sin)

    def make_layer(self, cfg, specs: dict, source, layer: int):
        """Decoder layer `layer` of this body (a body with another layer structure overrides it)."""
        return DecoderLayer(cfg, specs, source, self.mlp_for(cfg, layer), self.attention)

    def named_parameters(self) -> dict:
        """path -> the parameter's value (as the forward reads it), in declaration order."""
        out = {}
        for path in self.param_paths:
            node = self
            for part in path.split("."):
                node = node[int(part)] if part.isdigit() else getattr(node, part)
            out[path] = node[...]
        return out

    # -- forward ----------------------------------------------------------------------------------
    def __call__(self, input_ids, positions, token_req, block_tables, kv):
        """One step over T token rows.

        input_ids, positions, token_req [T]; block_tables [R, P] (each request's pages);
        kv: per layer, the (k_pages, v_pages) its KVCacheSpec entry declares, each
        [num_pages, page_size, Hkv, D]. Returns the final-norm hidden states [T, H] and the
        updated pages, in the same structure.
        """
        out, new_kv, _ = self.decode(input_ids, positions, token_req, block_tables, kv)
        return out, new_kv

    def decode(self, input_ids, positions, token_req, block_tables, kv):
        """`__call__`'s step, and per layer the expert ids int32[T, k] its MLP routed each row to
        (None for a dense MLP): a body with routing MLPs exports them (moe_decoder.py)."""
        cfg, kern = self.cfg, self.kernels
        pages0 = kv[0][0]
        page_size = pages0.shape[1]
        page = block_tables[token_req, positions // page_size]
        # Padding rows (and only they) map to the null page; their writes are sent out of bounds
        # and dropped, so every written (page, slot) is unique (see Attention.__call__).
        padding = page == NULL_PAGE
        page = jnp.where(padding, pages0.shape[0], page)
        slot = positions % page_size
        cos = self.rope_cos[...][positions]
        sin = self.rope_sin[...][positions]
        eps = cfg.rms_norm_eps

        h = self.embed_tokens(input_ids, tp=self.tp)
        residual = None
        new_kv, routed = [], []
        # Under the unfused boundary the norm reads the trainer's materialised residual (the sum
        # rounded to the model dtype); the fused leaf's round_sum gives those bits in one launch.
        unfused = self.unfused_norm
        # Where the model planned gemm_add_rmsnorm (one device), o_proj and down_proj are left to
        # the boundary after them (layers/linear.py: PendingProjection), which runs them with its
        # add + norm as one leaf.
        fuse = kern.gemm_add_rmsnorm is not None and self.tp is None

        def boundary(norm, out, residual):
            if isinstance(out, PendingProjection):
                return norm.add_projection(kern, out, residual, eps=eps, round_sum=unfused)
            return norm.add(kern, out, residual, eps=eps, round_sum=unfused)

        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = h
                x = layer.input_layernorm(kern, h, eps=eps)
            else:
                x, residual = boundary(layer.input_layernorm, h, residual)
            defer = {"pending": True} if fuse and layer.self_attn.defers_projection else {}
            attn, layer_kv = layer.self_attn(kern, x, kv[i], page=page, slot=slot, cos=cos, sin=sin,
                                             block_tables=block_tables, token_req=token_req,
                                             positions=positions, dtype=self.dtype, tp=self.tp,
                                             **defer)
            new_kv.append(layer_kv)
            x, residual = boundary(layer.post_attention_layernorm, attn, residual)
            if getattr(layer.mlp, "routed", None) is not None:  # a sparse MoE block
                h, ids = layer.mlp.routed(kern, x, dtype=self.dtype, tp=self.tp, padding=padding)
            else:
                defer = {"pending": True} if fuse and layer.mlp.defers_projection else {}
                h, ids = layer.mlp(kern, x, dtype=self.dtype, tp=self.tp, **defer), None
            routed.append(ids)
        out, _ = boundary(self.norm, h, residual)
        return out, tuple(new_kv), routed

    def compute_logits(self, hidden):
        """LM head: [n, H] -> [n, V] in the model dtype, widened to f32 (an exact conversion)."""
        return self.lm_head(self.kernels, hidden, out_dtype=self.dtype, tp=self.tp)


def _flatten(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, ParamSpec):
            yield path, value
        else:
            yield from _flatten(value, path + ".")


def _nest(flat: dict[str, ParamSpec]) -> dict:
    tree: dict = {}
    for path, spec in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = spec
    return tree


Model = DenseDecoder  # what a family whose body is this module builds (jengine/models/family.py)
