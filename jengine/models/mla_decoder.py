"""The decoder body of the MLA families (DeepSeek-V3): the dense body (jengine/models/dense.py) with
absorbed multi-head latent attention (jengine/models/layers/mla.py) in every layer, one latent KV
page per position (`LatentPages`), and the MLA attention leaf in the kernel plans in place of the
GQA one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp

from jengine.models import dense
from jengine.models.kv_cache import KVCacheSpec
from jengine.models.layers.mla import MLAttention
from jengine.models.layers.param import ParamSpec
from pallas_kernels.registry import KernelPlan, plan


@dataclass(frozen=True)
class ModelKernels:
    """The dense body's plans, with the absorbed MLA attention leaf instead of the GQA one."""

    gemm: KernelPlan
    gemm_group: KernelPlan
    rmsnorm: KernelPlan
    add_rmsnorm: KernelPlan
    silu: KernelPlan
    mla_attention: KernelPlan

    @classmethod
    def plan_for(cls, *, dtype, hardware: str, features=frozenset(),
                 head_dim: int | None = None) -> "ModelKernels":
        """head_dim (the rotary width) constrains no MLA leaf; accepted as the runner passes it."""
        base = dense.ModelKernels.plan_for(dtype=dtype, hardware=hardware, features=features)
        fmt = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float32): "f32"}[jnp.dtype(dtype)]
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(cls)
                      if f.name != "mla_attention"},
                   mla_attention=plan("attention", "mla_paged", formats={fmt}, hardware=hardware,
                                      features=features))

    def describe(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name).leaf.impl for f in dataclasses.fields(self)}


def param_specs(cfg, *, dtype, checkpoint_name: Callable[[str], str]) -> dict[str, ParamSpec]:
    return dense.param_specs(cfg, dtype=dtype, checkpoint_name=checkpoint_name,
                             attention=MLAttention)


def kv_cache_spec(cfg) -> KVCacheSpec:
    return KVCacheSpec(layers=(MLAttention.kv_pages(cfg),) * cfg.num_hidden_layers)


class MLADecoder(dense.DenseDecoder):
    attention = MLAttention

    def __init__(self, cfg, specs, source, *, tensor_parallel=None, **options):
        if tensor_parallel is not None:
            raise ValueError(f"{cfg.architecture}: tensor parallelism of MLA models is not "
                             "implemented (launch with --tp-size 1)")
        super().__init__(cfg, specs, source, **options)


Model = MLADecoder
