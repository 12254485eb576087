"""The decoder body of the MLA families (DeepSeek-V3): the dense body (jengine/models/dense.py) with
absorbed multi-head latent attention (jengine/models/layers/mla.py) in every layer, one latent KV
page per position (`LatentPages`), and the MLA attention leaf in the kernel plans in place of the
GQA one.

Layers from `first_k_dense_replace` on are DeepSeek-MoE layers (`DeepseekMoE`,
jengine/models/layers/deepseek_moe.py), as HF's `DeepseekV3DecoderLayer` picks them; the MoE
machinery is Qwen3-MoE's (jengine/models/moe_decoder.py): the routed experts through the
("moe", "grouped_gemm") plan, the slot-order combine, expert parallelism (--ep-size: the routed
experts split, the shared experts and everything else whole on every rank), EPLB, and the routed
expert ids as the step program's third output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp

from jengine.models import dense, moe_decoder
from jengine.models.family import MoEOptions
from jengine.models.kv_cache import KVCacheSpec
from jengine.models.layers.deepseek_moe import DeepseekMoE, plan_router
from jengine.models.layers.mla import MLAttention
from jengine.models.layers.mlp import SwiGLU
from jengine.models.layers.param import ParamSpec
from pallas_kernels.registry import KernelPlan, plan


@dataclass(frozen=True)
class ModelKernels:
    """The dense body's plans with the absorbed MLA attention leaf instead of the GQA one, and,
    when the launch plans MoE layers (`moe` given: jengine.launch does so for a config with
    experts), the DeepSeek-MoE plans (those of jengine/models/layers/deepseek_moe.py's set but
    the softmax router's, which no layer here calls). None for a config whose layers are all
    dense."""

    gemm: KernelPlan
    gemm_group: KernelPlan
    rmsnorm: KernelPlan
    add_rmsnorm: KernelPlan
    silu: KernelPlan
    mla_attention: KernelPlan
    grouped_gemm: KernelPlan | None = None
    combine_order: str | None = None
    expert_backend: str | None = None
    router_gemm: KernelPlan | None = None
    router_grouped_topk: KernelPlan | None = None
    # The dense body's experimental fused leaves (dense.ModelKernels), planned on request.
    gemm_add_rmsnorm: KernelPlan | None = None
    gemm_swiglu: KernelPlan | None = None

    @classmethod
    def plan_for(cls, *, dtype, hardware: str, features=frozenset(), head_dim: int | None = None,
                 kv_lora_rank: int | None = None, moe: MoEOptions | None = None) -> "ModelKernels":
        """head_dim (the rotary width, qk_rope_head_dim) and kv_lora_rank: the latent's two widths,
        which the Triton MLA leaf constrains (powers of two); a plan given neither gets a leaf that
        takes any width."""
        base = dense.ModelKernels.plan_for(dtype=dtype, hardware=hardware, features=features)
        fmt = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float32): "f32"}[jnp.dtype(dtype)]
        moe_plans = {}
        if moe is not None:
            moe_plans = {**moe_decoder.plan_experts(base.gemm, dtype=dtype, hardware=hardware,
                                                    features=features, moe=moe),
                         **plan_router(moe, hardware=hardware, features=features)}
        dense_fields = {"gemm", "gemm_group", "rmsnorm", "add_rmsnorm", "silu", "gemm_add_rmsnorm",
                        "gemm_swiglu"}
        latent_geometry = {k: v for k, v in (("kv_lora_rank", kv_lora_rank),
                                             ("qk_rope_head_dim", head_dim)) if v is not None}
        return cls(**{name: getattr(base, name) for name in dense_fields},
                   mla_attention=plan("attention", "mla_paged", formats={fmt}, hardware=hardware,
                                      features=features, geometry=latent_geometry),
                   **moe_plans)

    def describe(self) -> dict[str, str]:
        def name(value):
            return value if value is None or isinstance(value, str) else value.leaf.impl

        return {f.name: name(getattr(self, f.name)) for f in dataclasses.fields(self)}


def deepseek_mlp(cfg, layer: int):
    """HF DeepseekV3DecoderLayer's rule: MoE from layer first_k_dense_replace on."""
    return DeepseekMoE if layer >= cfg.first_k_dense_replace else SwiGLU


def param_specs(cfg, *, dtype, checkpoint_name: Callable[[str], str]) -> dict[str, ParamSpec]:
    return dense.param_specs(cfg, dtype=dtype, checkpoint_name=checkpoint_name,
                             mlp_for=deepseek_mlp, attention=MLAttention)


def kv_cache_spec(cfg) -> KVCacheSpec:
    return KVCacheSpec(layers=(MLAttention.kv_pages(cfg),) * cfg.num_hidden_layers)


class MLADecoder(moe_decoder.MoEDecoder):
    attention = MLAttention
    mlp_for = staticmethod(deepseek_mlp)

    def __init__(self, cfg, specs, source, *, kernels, tensor_parallel=None, **options):
        if tensor_parallel is not None:
            raise ValueError(f"{cfg.architecture}: tensor parallelism of MLA models is not "
                             "implemented (launch with --tp-size 1)")
        if self._has_moe_layers(cfg) and kernels.router_grouped_topk is None:
            raise ValueError(f"{cfg.architecture}: layers {cfg.first_k_dense_replace}.."
                             f"{cfg.num_hidden_layers - 1} are MoE layers but the kernel set has "
                             "no MoE plans (plan it with moe=MoEOptions(...))")
        super().__init__(cfg, specs, source, kernels=kernels, **options)

    @staticmethod
    def _has_moe_layers(cfg) -> bool:
        return cfg.first_k_dense_replace < cfg.num_hidden_layers

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """(layers, k) of a row's routed expert ids (`forward_routed`); None when every layer is
        dense: the step program is then the dense one, with no routed output."""
        return super().routing_shape if self._has_moe_layers(self.cfg) else None


Model = MLADecoder
