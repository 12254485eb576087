"""The decoder body of the MoE families (Qwen3-MoE): the dense body (jengine/models/dense.py) with a
sparse MoE block (jengine/models/layers/moe.py) as the MLP of its sparse layers, and the router's
kernel plan next to the dense plans.

A layer is sparse when HF's `Qwen3MoeDecoderLayer` makes it so: not in `mlp_only_layers`, and
`(layer + 1) % decoder_sparse_step == 0`; the others keep the dense SwiGLU of width
intermediate_size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp

from jengine.models import dense
from jengine.models.family import MoEOptions
from jengine.models.layers.mlp import SwiGLU
from jengine.models.layers.moe import SparseMoE
from jengine.models.layers.param import ParamSpec
from pallas_kernels.registry import KernelPlan, KernelPlanError, plan

kv_cache_spec = dense.kv_cache_spec


def moe_mlp(cfg, layer: int):
    """HF Qwen3MoeDecoderLayer's rule for which layers route to experts."""
    sparse = layer not in cfg.mlp_only_layers and (layer + 1) % cfg.decoder_sparse_step == 0
    return SparseMoE if sparse else SwiGLU


@dataclass(frozen=True)
class ModelKernels(dense.ModelKernels):
    """The dense plans, the router's top-k plan and the combine order of the launch."""

    router_topk: KernelPlan
    # The routed expert GEMMs (batch_invariant backend): the ("moe", "grouped_gemm") leaf of the
    # gemm plan's impl, so each routed row has that gemm leaf's bits; None under portable.
    grouped_gemm: KernelPlan | None
    combine_order: str  # "slot" / "rank": the same fold on one device (jengine/models/layers/moe.py)
    # --moe-backend, resolved: "batch_invariant" (each expert through the GEMM plans above, so a
    # row's bits are those plans') or "portable" (one XLA einsum over the stacked experts: fast to
    # compile, no batch-invariance claim). auto = batch_invariant when the launch requires it.
    expert_backend: str

    @classmethod
    def plan_for(cls, *, dtype, hardware: str, features=frozenset(), head_dim: int | None = None,
                 moe: MoEOptions = MoEOptions()) -> "ModelKernels":
        base = dense.ModelKernels.plan_for(dtype=dtype, hardware=hardware, features=features,
                                           head_dim=head_dim)
        impl = None if moe.router_topk == "auto" else moe.router_topk
        try:
            # The router's logits are widened to f32 whatever the model dtype (HF: softmax in float).
            router = plan("moe", "router_topk", formats={"f32"}, hardware=hardware,
                          features=features, impl=impl)
        except KernelPlanError as exc:
            raise KernelPlanError(f"--router-topk {moe.router_topk}: no eligible leaf of "
                                  f"moe.router_topk ({exc})") from None
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                   router_topk=router, **plan_experts(base.gemm, dtype=dtype, hardware=hardware,
                                                      features=features, moe=moe))

    def describe(self) -> dict[str, str]:
        def name(value):
            return value if value is None or isinstance(value, str) else value.leaf.impl

        return {f.name: name(getattr(self, f.name)) for f in dataclasses.fields(self)}


def plan_experts(gemm: KernelPlan, *, dtype, hardware: str, features, moe: MoEOptions) -> dict:
    """The routed experts' fields of a MoE kernel set (grouped_gemm, combine_order,
    expert_backend) under the launch's MoE switches; `gemm`: the model's gemm plan."""
    if moe.combine_order not in ("rank", "slot"):
        raise ValueError(f"moe_combine_order={moe.combine_order!r} must be 'rank' or 'slot'")
    backend = moe.backend
    if backend == "auto":
        backend = "batch_invariant" if "batch_invariant" in features else "portable"
    if backend not in ("batch_invariant", "portable"):
        raise ValueError(f"--moe-backend {moe.backend!r} is not one of auto, batch_invariant, "
                         "portable")
    if backend == "portable" and "batch_invariant" in features:
        raise KernelPlanError("--moe-backend portable: its einsum declares no batch_invariant "
                              "feature, which this launch requires")
    grouped = None
    if backend == "batch_invariant":
        grouped = _plan_grouped_gemm(gemm, dtype=dtype, hardware=hardware, features=features)
    return dict(grouped_gemm=grouped, combine_order=moe.combine_order, expert_backend=backend)


def _plan_grouped_gemm(gemm: KernelPlan, *, dtype, hardware: str, features) -> KernelPlan:
    """The grouped leaf of the gemm plan's impl where one exists (its rows then have the model's
    gemm bits, which trainer mode's GEMM twin reproduces); otherwise (an auto launch whose gemm is
    XLA's dot) the best batch-invariant grouped leaf: the experts are still batch invariant, just
    not the same arithmetic as the dense layers' GEMMs."""
    kw = dict(formats={"bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "f32"}, hardware=hardware,
              features=frozenset(features) | {"batch_invariant"})
    try:
        return plan("moe", "grouped_gemm", impl=gemm.leaf.impl, **kw)
    except KernelPlanError:
        return plan("moe", "grouped_gemm", **kw)


def param_specs(cfg, *, dtype, checkpoint_name: Callable[[str], str]) -> dict[str, ParamSpec]:
    return dense.param_specs(cfg, dtype=dtype, checkpoint_name=checkpoint_name, mlp_for=moe_mlp)


class MoEDecoder(dense.DenseDecoder):
    mlp_for = staticmethod(moe_mlp)

    def __init__(self, cfg, specs, source, *, tensor_parallel=None, expert_parallel=None,
                 expert_placement=None, **options):
        """expert_parallel: a sharding.expert_parallel.ExpertParallel when the forward runs as one
        rank's shard inside shard_map with the experts split (--ep-size), else None.
        expert_placement: under --enable-eplb, int32[layers, P]: each sparse layer's
        physical_to_logical map (sharding/eplb.py; dense layers' rows unused), else None."""
        if tensor_parallel is not None:
            raise ValueError(f"{cfg.architecture}: tensor parallelism of MoE models is not "
                             "implemented (launch with --tp-size 1)")
        super().__init__(cfg, specs, source, **options)
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.ep = expert_parallel
                if expert_placement is not None:
                    layer.mlp.place_experts(expert_placement[i])

    @property
    def routing_shape(self) -> tuple[int, int]:
        """(layers, k) of one token row's routed expert ids, as `forward_routed` exports them."""
        return self.cfg.num_hidden_layers, self.cfg.num_experts_per_tok

    def forward_routed(self, input_ids, positions, token_req, block_tables, kv):
        """`__call__`'s (hidden [T, H], pages) and the expert ids int32[T, layers, k] each row was
        routed to by each layer (SGLang's routed_experts layout per token). A dense layer of the
        body (mlp_only_layers, decoder_sparse_step) routes nowhere: its k ids are -1, as SGLang's."""
        out, new_kv, routed = self.decode(input_ids, positions, token_req, block_tables, kv)
        t, k = input_ids.shape[0], self.cfg.num_experts_per_tok
        none = jnp.full((t, k), -1, jnp.int32)
        ids = jnp.stack([none if r is None else r.astype(jnp.int32) for r in routed], axis=1)
        return out, new_kv, ids


Model = MoEDecoder
