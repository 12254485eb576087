"""("activation", "silu"): SiLU in f32 as ``x / (1 + exp(-x))``, rounded once to the input dtype.

``times``: SwiGLU's gate, ``silu(gate) * up`` -- HF's ``act_fn(gate_proj(x)) * up_proj(x)``, the
SiLU rounded to the dtype, then the product rounded again -- in one leaf, so a GPU runs one launch
where the SiLU and XLA's multiply took two (32 a decode step of an 8B model). The same two
roundings, so the same bits as the separate multiply.

That is torch's own form (ActivationSiluKernel); XLA's ``jax.nn.silu`` is ``x * sigmoid(x)`` and
differs in 26 % of f32 results on the H200. The trainer's ``F.silu`` is routed to this leaf's twin
under trainer mode (interop), so both sides run one definition.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._twin import torch_twin
from pallas_kernels.registry import Priority, declare_family, register


def _silu_signature(x, *, times=None):
    """x of any shape, bf16|f32 (times: None or x's shape and dtype) -> silu(x) [* times]."""


declare_family("activation", "silu", _silu_signature)


@register("activation", "silu", "elementwise", formats={"bf16", "f32"}, hardware={"any"},
          priority=Priority.PORTABLE, traits={"deterministic": True, "batch_invariant": True},
          features={"batch_invariant"})
def silu(x, *, times=None):
    check_times(x, times)
    xf = x.astype(jnp.float32)
    y = (xf / (1.0 + jnp.exp(-xf))).astype(x.dtype)
    return y if times is None else y * times


def check_times(x, times) -> None:
    """Every silu leaf's check of `times` (jax or torch arrays alike)."""
    if times is not None and (tuple(times.shape) != tuple(x.shape) or times.dtype != x.dtype):
        raise ValueError(f"silu: times has shape {tuple(times.shape)} and dtype {times.dtype}; "
                         f"it must match x's {tuple(x.shape)} and {x.dtype}")


silu_torch = torch_twin(silu)


# --numerics auto's SiLU: the same expression, left to XLA. On a GPU the triton_elementwise leaf
# (TUNED) gives torch's bits but is a custom call, and jax-triton's custom calls are not captured
# in XLA's command buffers: each one splits the step's CUDA graph, so the step paid a graph launch
# and a kernel launch more per layer on the host (H200 profile, docs/performance.md). Here XLA
# fuses silu(gate) * up into one kernel inside the graph. Its GPU division is not IEEE-rounded, so
# it does not declare the batch_invariant feature: rl-bitwise keeps the leaves whose bits are the
# contract's (triton_elementwise on a GPU, elementwise elsewhere -- the same HLO as this leaf).
@register("activation", "silu", "xla_native", formats={"bf16", "f32"}, hardware={"any"},
          priority=Priority.TUNED + 1, traits={"deterministic": True, "batch_invariant": True})
def silu_xla_native(x, *, times=None):
    return silu(x, times=times)
