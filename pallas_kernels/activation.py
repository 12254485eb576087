"""("activation", "silu"): SiLU in f32 as ``x / (1 + exp(-x))``, rounded once to the input dtype.

That is torch's own form (ActivationSiluKernel); XLA's ``jax.nn.silu`` is ``x * sigmoid(x)`` and
differs in 26 % of f32 results on the H200. The trainer's ``F.silu`` is routed to this leaf's twin
under trainer mode (interop), so both sides run one definition.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._twin import torch_twin
from pallas_kernels.registry import Priority, declare_family, register


def _silu_signature(x):
    """x of any shape, bf16|f32 -> silu(x), same shape and dtype."""


declare_family("activation", "silu", _silu_signature)


@register("activation", "silu", "elementwise", formats={"bf16", "f32"}, hardware={"any"},
          priority=Priority.PORTABLE, traits={"deterministic": True, "batch_invariant": True},
          features={"batch_invariant"})
def silu(x):
    xf = x.astype(jnp.float32)
    return (xf / (1.0 + jnp.exp(-xf))).astype(x.dtype)


silu_torch = torch_twin(silu)
