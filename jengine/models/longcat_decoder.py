"""The decoder body of LongCat-Flash (jengine/models/longcat_flash.py): HF's
`LongcatFlashDecoderLayer`, two sublayers and a shortcut MoE per layer, in HF's operation order:

    residual = h;            x = input_layernorm[0](h);   h = residual + self_attn[0](x)
    residual = h;            x = post_attention_layernorm[0](h)
    shortcut = mlp(x)        (the MoE, jengine/models/layers/deepseek_moe.py: softmax router, zero
                              experts, slot-order combine)
    h = residual + mlps[0](x)
    residual = h;            x = input_layernorm[1](h);   h = residual + self_attn[1](x)
    residual = h;            x = post_attention_layernorm[1](h)
    h = (residual + mlps[1](x)) + shortcut               two adds in the model dtype, HF's order

Each attention block is absorbed MLA (jengine/models/layers/mla.py) with the LoRA norm scales where
--mla-lora-scale puts them, and its own latent cache: the KV spec declares 2 * num_layers
`LatentPages` entries, block j of layer i reading and writing entry 2 i + j (HF's layer_idx).
Under --layer-boundary-norm fused each norm that follows an add is the fused add + RMSNorm leaf
(the same sums; the norm's own rounding may differ), unfused materialises the sum first (the
trainer's form, what rl-bitwise pins).

One device: tensor and expert parallelism are refused (the zero experts' identity residual has no
expert-parallel form yet, jengine/models/layers/moe.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from jengine.models import dense, mla_decoder
from jengine.models.family import MoEOptions
from jengine.models.kv_cache import NULL_PAGE, KVCacheSpec
from jengine.models.layers import deepseek_moe
from jengine.models.layers.deepseek_moe import DeepseekMoE
from jengine.models.layers.embedding import Embedding
from jengine.models.layers.lm_head import LMHead
from jengine.models.layers.mla import MLAttention
from jengine.models.layers.mlp import SwiGLU
from jengine.models.layers.norm import RMSNorm
from jengine.models.layers.param import ParamSpec
from pallas_kernels.registry import KernelPlan

SUBLAYERS = 2  # attention blocks (and dense MLPs) per decoder layer


@dataclass(frozen=True)
class ModelKernels(deepseek_moe.ModelKernels):
    """The DeepSeek MoE plans (router GEMM and grouped top-k, experts, combine) with the absorbed
    MLA attention leaf; no GQA attention leaf (`attention` is None)."""

    mla_attention: KernelPlan

    @classmethod
    def plan_for(cls, *, dtype, hardware: str, features=frozenset(), head_dim: int | None = None,
                 kv_lora_rank: int | None = None, moe: MoEOptions = MoEOptions()) -> "ModelKernels":
        base = deepseek_moe.ModelKernels.plan_for(dtype=dtype, hardware=hardware,
                                                  features=features, moe=moe)
        mla = mla_decoder.ModelKernels.plan_for(dtype=dtype, hardware=hardware, features=features,
                                                head_dim=head_dim, kv_lora_rank=kv_lora_rank)
        return cls(**{**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                      "attention": None}, mla_attention=mla.mla_attention)


class LongcatDecoderLayer(nnx.Module):
    @staticmethod
    def specs(cfg, *, dtype) -> dict[str, dict]:
        def pair(make):
            return {str(j): make() for j in range(SUBLAYERS)}

        return {"input_layernorm": pair(lambda: RMSNorm.specs(cfg.hidden_size, "embed", dtype=dtype)),
                "self_attn": pair(lambda: MLAttention.specs(cfg, dtype=dtype)),
                "post_attention_layernorm": pair(
                    lambda: RMSNorm.specs(cfg.hidden_size, "embed", dtype=dtype)),
                "mlps": pair(lambda: SwiGLU.specs(cfg, dtype=dtype)),
                "mlp": DeepseekMoE.specs(cfg, dtype=dtype)}

    def __init__(self, cfg, specs: dict, source, *, lora_scale: str):
        def pair(make):
            return nnx.List([make(str(j)) for j in range(SUBLAYERS)])

        self.input_layernorm = pair(lambda j: RMSNorm(specs["input_layernorm"][j], source))
        self.self_attn = pair(lambda j: MLAttention(cfg, specs["self_attn"][j], source,
                                                    lora_scale=lora_scale))
        self.post_attention_layernorm = pair(
            lambda j: RMSNorm(specs["post_attention_layernorm"][j], source))
        self.mlps = pair(lambda j: SwiGLU(cfg, specs["mlps"][j], source))
        self.mlp = DeepseekMoE(cfg, specs["mlp"], source)


def param_specs(cfg, *, dtype, checkpoint_name: Callable[[str], str]) -> dict[str, ParamSpec]:
    tree = {"embed_tokens": Embedding.specs(cfg, dtype=dtype),
            "layers": {str(i): LongcatDecoderLayer.specs(cfg, dtype=dtype)
                       for i in range(cfg.num_hidden_layers)},
            "norm": RMSNorm.specs(cfg.hidden_size, "embed", dtype=dtype),
            "lm_head": LMHead.specs(cfg, dtype=dtype)}
    return {path: spec.named(checkpoint_name(path)) for path, spec in dense._flatten(tree)}


def kv_cache_spec(cfg) -> KVCacheSpec:
    return KVCacheSpec(layers=(MLAttention.kv_pages(cfg),) * (SUBLAYERS * cfg.num_hidden_layers))


class LongcatDecoder(dense.DenseDecoder):
    """Weights and forward of LongCat-Flash; `named_parameters` and `compute_logits` are the dense
    body's."""

    def __init__(self, cfg, specs: dict[str, ParamSpec], source, *, dtype, kernels: ModelKernels,
                 mla_lora_scale: str, layer_boundary_norm: str = "unfused",
                 rope_frequency_device: str = "device", rope_ramp_device: str = "cpu",
                 tensor_parallel=None, expert_parallel=None, expert_placement=None):
        if tensor_parallel is not None:
            raise ValueError(f"{cfg.architecture}: tensor parallelism is not implemented (launch "
                             "with --tp-size 1)")
        if expert_parallel is not None or expert_placement is not None:
            raise ValueError(f"{cfg.architecture}: expert parallelism is not implemented (the zero "
                             "experts' identity residual has no expert-parallel form); launch "
                             "with --ep-size 1")
        self.mla_lora_scale = mla_lora_scale
        super().__init__(cfg, specs, source, dtype=dtype, kernels=kernels,
                         layer_boundary_norm=layer_boundary_norm,
                         rope_frequency_device=rope_frequency_device,
                         rope_ramp_device=rope_ramp_device)

    def make_layer(self, cfg, specs: dict, source, layer: int):
        return LongcatDecoderLayer(cfg, specs, source, lora_scale=self.mla_lora_scale)

    @property
    def routing_shape(self) -> tuple[int, int]:
        """(layers, k): every layer's shortcut MoE routes each row to k experts."""
        return self.cfg.num_hidden_layers, self.cfg.num_experts_per_tok

    def forward_routed(self, input_ids, positions, token_req, block_tables, kv):
        """`__call__`'s (hidden, pages) and the expert ids int32[T, layers, k] (-1: a zero
        expert, which no expert computed)."""
        out, new_kv, routed = self.decode(input_ids, positions, token_req, block_tables, kv)
        return out, new_kv, jnp.stack(routed, axis=1)

    def _add_norm(self, norm, delta, residual, eps):
        """(norm(residual + delta), residual + delta) in the fused add + RMSNorm leaf; under unfused
        the norm reads the sum rounded to the model dtype (round_sum: the materialised sum's
        bits). residual None: norm(delta) alone (the first layer)."""
        if residual is None:
            return norm(self.kernels, delta, eps=eps), delta
        return norm.add(self.kernels, delta, residual, eps=eps, round_sum=self.unfused_norm)

    def decode(self, input_ids, positions, token_req, block_tables, kv):
        kern, eps, dtype = self.kernels, self.cfg.rms_norm_eps, self.dtype
        pages0 = kv[0][0]
        page_size = pages0.shape[1]
        page = block_tables[token_req, positions // page_size]
        padding = page == NULL_PAGE
        page = jnp.where(padding, pages0.shape[0], page)  # padding rows: dropped writes
        slot = positions % page_size
        cos = self.rope_cos[...][positions]
        sin = self.rope_sin[...][positions]
        attend = dict(page=page, slot=slot, cos=cos, sin=sin, block_tables=block_tables,
                      token_req=token_req, positions=positions, dtype=dtype)

        delta, residual = self.embed_tokens(input_ids), None  # h = residual + delta, pending
        new_kv, routed = [], []
        for i, layer in enumerate(self.layers):
            shortcut = None
            for j in range(SUBLAYERS):
                x, residual = self._add_norm(layer.input_layernorm[j], delta, residual, eps)
                attn, pages = layer.self_attn[j](kern, x, kv[SUBLAYERS * i + j], **attend)
                new_kv.append(pages)
                x, residual = self._add_norm(layer.post_attention_layernorm[j], attn, residual, eps)
                if j == 0:
                    shortcut, ids = layer.mlp.routed(kern, x, dtype=dtype, padding=padding)
                    routed.append(ids)
                delta = layer.mlps[j](kern, x, dtype=dtype)
            residual = residual + delta  # HF: (residual + mlps[1](x)) + shortcut
            delta = shortcut
        out, _ = self._add_norm(self.norm, delta, residual, eps)
        return out, tuple(new_kv), routed


Model = LongcatDecoder
