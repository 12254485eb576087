"""SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up as one grouped GEMM (or, where the model
planned the experimental gemm_swiglu leaf, gate, up and the activation as one leaf)."""

from __future__ import annotations

from flax import nnx

from jengine.models.layers.linear import Linear, PendingProjection, linears


class SwiGLU(nnx.Module):
    defers_projection = True  # __call__ takes pending= (see there)

    @staticmethod
    def specs(cfg, *, dtype) -> dict[str, dict]:
        h, i = cfg.hidden_size, cfg.intermediate_size
        return {"gate_proj": Linear.specs(h, i, ("embed", "mlp"), bias=False, dtype=dtype),
                "up_proj": Linear.specs(h, i, ("embed", "mlp"), bias=False, dtype=dtype),
                "down_proj": Linear.specs(i, h, ("down_mlp", "down_embed"), bias=False,
                                          dtype=dtype)}

    def __init__(self, cfg, specs: dict, source):
        self.gate_proj = Linear(specs["gate_proj"], source)
        self.up_proj = Linear(specs["up_proj"], source)
        self.down_proj = Linear(specs["down_proj"], source)

    def __call__(self, kern, x, *, dtype, tp=None, pending=False):
        """tp (sharding.tensor_parallel.TensorParallel, inside shard_map): gate/up are
        column-parallel over "mlp"; down_proj is the "down" reduction site (row-parallel, or
        column-parallel on hidden under --tp-batch-invariant all).
        pending (one device only): a PendingProjection of down_proj instead of its output, for
        the layer boundary to run (dense.py)."""
        if kern.gemm_swiglu is not None and tp is None:
            act = kern.gemm_swiglu(x, self.gate_proj.weight[...], self.up_proj.weight[...],
                                   out_dtype=dtype)
        else:
            gate, up = linears(kern, x, (self.gate_proj, self.up_proj), out_dtype=dtype)
            # silu(gate) * up in one leaf: the two roundings of HF's act_fn(gate) * up.
            act = kern.silu(gate, times=up)
        if pending:
            if tp is not None:
                raise ValueError("SwiGLU: pending=True is for one device (tp=None)")
            return PendingProjection(self.down_proj, act)
        return self.down_proj(kern, act, out_dtype=dtype, tp=tp, site="down")
