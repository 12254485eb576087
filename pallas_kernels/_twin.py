"""Torch twins of JAX leaves on the CPU: the *same compiled XLA program*, called from torch.

On the CPU the two frameworks' own math differs (XLA contracts a*b+c into FMA with no flag to stop
it; exp/log/rsqrt/sin/cos are different polynomials; platform-facts.md), so a torch re-implementation
of a leaf cannot reproduce its bits. The twin therefore runs the leaf's jitted JAX function on the
torch tensors through DLPack (zero copy on the CPU), which returns XLA's bits exactly. On a GPU the
twin of a Triton leaf is the same Triton source launched from torch (see the leaf modules).

torch is imported lazily: serving never needs it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def to_jax(t) -> jax.Array:
    """torch.Tensor -> jax.Array without changing a bit (bf16 included)."""
    import torch

    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        # DLPack carries bf16; go through a uint16 view where a runtime refuses it.
        try:
            return jax.dlpack.from_dlpack(t)
        except Exception:  # pragma: no cover - depends on the jax/torch pair
            return jax.lax.bitcast_convert_type(jnp.asarray(t.view(torch.int16).numpy()), jnp.bfloat16)
    return jax.dlpack.from_dlpack(t)


def to_torch(x):
    """jax.Array -> torch.Tensor without changing a bit."""
    import torch

    if not isinstance(x, jax.Array):
        return x
    try:
        return torch.from_dlpack(x)
    except Exception:  # pragma: no cover
        arr = np.asarray(x)
        if arr.dtype == jnp.bfloat16:
            return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(arr.copy())


def torch_twin(jax_fn: Callable[..., Any], **jit_kwargs) -> Callable[..., Any]:
    """Wrap a JAX leaf so torch code can call it on tensors and get tensors back, same bits."""
    jitted = jax.jit(jax_fn, **jit_kwargs)

    @functools.wraps(jax_fn)
    def twin(*args, **kwargs):
        out = jitted(*[to_jax(a) for a in args], **{k: to_jax(v) for k, v in kwargs.items()})
        return jax.tree.map(to_torch, out)

    return twin
