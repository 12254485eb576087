"""DeepSeek-V3's MoE layer (HF `DeepseekV3MoE`): the correction-bias router, routed SwiGLU experts with
the slot-order combine of `SparseMoE`, shared experts, and LongCat-Flash's zero (identity) experts.

    logits        = gemm(x as f32, gate)             f32, as HF (_keep_in_fp32_modules_strict)
    ids, weights  = router_grouped_topk(logits, e_score_correction_bias)    the plan; f32 weights
                                                     (sigmoid, group-limited top-k, norm, scale)
    weights       -> model dtype                     as SparseMoE: the weight enters the activation
    routed        = SparseMoE.combine(x, ids, weights)   slot order, f32 fold, rounded once
    out           = routed + shared_experts(x)       one add in the model dtype, HF's order

Zero experts (LongCat-Flash, `zero_expert_num` > 0): router ids >= num_experts are identity
experts. transformers 5.24's `LongcatFlashExperts` computes their term as x * weight rounded to the
model dtype and adds it with the real experts' terms; here that term sits in its slot of the same
f32 slot-order fold (`SparseMoE.combine(identity=...)`), and the exported routed ids carry -1 for
it (the spec's convention: no expert computed it).

HF differs in two rounding points (both replaced by trainer mode, interop/trainer_moe.py): its f32
routing weight scales after down_proj, and its eager combine adds in ascending expert id in the model
dtype. So against stock HF this layer agrees within rounding; under trainer mode bit for bit.

Config fields (a ModelConfig carrying them, or any object with these attributes): hidden_size,
num_experts (routed experts: HF n_routed_experts), num_experts_per_tok, moe_intermediate_size,
norm_topk_prob, n_group, topk_group, routed_scaling_factor, n_shared_experts (0: none),
zero_expert_num (0: none), router_score ("sigmoid" DeepSeek-V3, "softmax" LongCat-Flash).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import jax.numpy as jnp
from flax import nnx

from jengine.models import moe_decoder
from jengine.models.family import MoEOptions
from jengine.models.layers.linear import Linear
from jengine.models.layers.mlp import SwiGLU
from jengine.models.layers.moe import SparseMoE, _Experts
from jengine.models.layers.param import ParamSpec
from pallas_kernels.moe_router_grouped import plan_router_grouped_topk
from pallas_kernels.registry import KernelPlan, KernelPlanError, plan


@dataclass(frozen=True)
class ModelKernels(moe_decoder.ModelKernels):
    """The MoE plans plus the correction-bias router's: its f32 gate GEMM and its top-k leaf."""

    router_gemm: KernelPlan
    router_grouped_topk: KernelPlan

    @classmethod
    def plan_for(cls, *, dtype, hardware: str, features=frozenset(), head_dim: int | None = None,
                 moe: MoEOptions = MoEOptions()) -> "ModelKernels":
        base = moe_decoder.ModelKernels.plan_for(dtype=dtype, hardware=hardware, features=features,
                                                 head_dim=head_dim, moe=moe)
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                   **plan_router(moe, hardware=hardware, features=features))


def plan_router(moe: MoEOptions, *, hardware: str, features) -> dict:
    """The correction-bias router's fields of a kernel set: its f32 gate GEMM and top-k plans."""
    try:
        router = plan_router_grouped_topk(moe.router_topk, hardware=hardware, features=features)
    except KernelPlanError as exc:
        raise KernelPlanError(f"--router-topk {moe.router_topk}: no eligible leaf of "
                              f"moe.router_grouped_topk ({exc})") from None
    return dict(router_gemm=plan("linear", "gemm", formats={"f32"}, hardware=hardware,
                                 features=features),
                router_grouped_topk=router)


class DeepseekMoE(SparseMoE):
    @staticmethod
    def specs(cfg, *, dtype) -> dict[str, dict]:
        h, scored = cfg.hidden_size, cfg.num_experts + cfg.zero_expert_num
        specs = SparseMoE.specs(cfg, dtype=dtype)
        # The router is held as HF holds it after a load in the model dtype: f32 for DeepSeek-V3,
        # the model dtype for LongCat-Flash (ModelConfig.router_in_fp32); it computes in f32.
        router_dtype = jnp.float32 if cfg.router_in_fp32 else dtype
        specs["gate"] = {
            **Linear.specs(h, scored, ("embed", "router_expert"), bias=False, dtype=router_dtype),
            "e_score_correction_bias": ParamSpec((scored,), router_dtype, ("router_expert",))}
        if cfg.n_shared_experts:
            width = cfg.n_shared_experts * cfg.moe_intermediate_size
            specs["shared_experts"] = SwiGLU.specs(
                SimpleNamespace(hidden_size=h, intermediate_size=width), dtype=dtype)
        return specs

    def __init__(self, cfg, specs: dict, source):
        _check_config(cfg)
        self.top_k = cfg.num_experts_per_tok
        self.gate = _Router(specs["gate"], source)
        self.experts = _Experts(specs["experts"], source)
        self.ep = None                   # as SparseMoE: set by the MoE body under --ep-size
        self.physical_to_logical = None  # as SparseMoE: set by place_experts under --enable-eplb
        self.routing = dict(n_group=cfg.n_group, topk_group=cfg.topk_group,
                            norm_topk_prob=bool(cfg.norm_topk_prob),
                            routed_scaling_factor=float(cfg.routed_scaling_factor),
                            score=cfg.router_score)
        self.num_routed = cfg.num_experts
        self.zero_experts = cfg.zero_expert_num
        self.shared_experts = (SwiGLU(None, specs["shared_experts"], source)
                               if "shared_experts" in specs else None)

    def routed(self, kern, x, *, dtype, tp=None, padding=None):
        """(the layer's output [T, H] in `dtype`, the routed expert ids int32[T, k]; -1 for a zero
        expert). kern: a `ModelKernels` of this module. padding: as SparseMoE.combine's."""
        if tp is not None:
            raise ValueError("tensor parallelism of a MoE block is not implemented (MoE TP = 1)")
        ids, weights = self.route(kern, x, dtype=dtype)
        identity = None
        if self.zero_experts:
            identity = ids >= self.num_routed
            ids = jnp.where(identity, jnp.int32(-1), ids)
        expert_ids = ids if identity is None else jnp.where(identity, 0, ids)  # a placeholder id
        out = self.combine(kern, x, expert_ids, weights, dtype=dtype, identity=identity,
                           padding=padding)
        if self.shared_experts is not None:
            out = out + self.shared_experts(kern, x, dtype=dtype)  # HF: routed + shared, in dtype
        return out, ids

    def route(self, kern, x, *, dtype):
        """(router ids int32[T, k] over the scored experts, zero experts included; routing weights
        [T, k] in `dtype`) for the rows of x."""
        logits = kern.router_gemm(x.astype(jnp.float32), self.gate.weight[...].astype(jnp.float32),
                                  None, out_dtype=jnp.float32)
        bias = self.gate.e_score_correction_bias[...].astype(jnp.float32)
        ids, weights = kern.router_grouped_topk(logits, bias,
                                                k=self.top_k, **self.routing)
        return ids, weights.astype(dtype)


class _Router(nnx.Module):
    """The f32 gate weight [H, scored experts] and its e_score_correction_bias [scored experts]."""

    def __init__(self, specs: dict, source):
        self.weight = nnx.Param(source.place(specs["weight"]))
        self.e_score_correction_bias = nnx.Param(source.place(specs["e_score_correction_bias"]))


def _check_config(cfg) -> None:
    if cfg.router_score not in ("sigmoid", "softmax"):
        raise ValueError(f"router_score={cfg.router_score!r} must be 'sigmoid' (DeepSeek-V3) or "
                         "'softmax' (LongCat-Flash)")
    for name in ("n_shared_experts", "zero_expert_num"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if cfg.routed_scaling_factor <= 0:
        raise ValueError(f"routed_scaling_factor must be positive, got {cfg.routed_scaling_factor!r}")
