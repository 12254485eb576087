"""Shared plumbing of the Triton leaves: availability, dtype names, and the two launchers.

Every Triton leaf is one `@triton.jit` source (pallas_kernels/_triton_kernels.py) with two hosts:
`jax_launch` goes through jax-triton's `triton_call` (an XLA custom call), `torch_launch` through
Triton's own launcher on torch tensors. Both pass the same constexprs, num_warps and num_stages, so
they compile the same program.

Nothing here imports triton, jax_triton or torch at module import: the CPU machines have none of
the first two, and serving never needs torch.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The batch-invariant leaf declaration every Triton leaf makes (registry.py: traits vs features).
INVARIANT = dict(traits={"deterministic": True, "batch_invariant": True},
                 features={"batch_invariant"})


def triton_available() -> bool:
    """True when both triton and jax_triton are importable (checked without importing them)."""
    return (importlib.util.find_spec("triton") is not None
            and importlib.util.find_spec("jax_triton") is not None)


def kernels():
    """The module of @triton.jit sources, imported on first use."""
    from pallas_kernels import _triton_kernels

    return _triton_kernels


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_NAMES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def dtype_name(dtype) -> str:
    """'bf16' / 'f32' / ... for a jax, numpy or torch dtype (or the name itself)."""
    if isinstance(dtype, str):
        return _NAMES.get(dtype, dtype)
    text = str(dtype)
    if text.startswith("torch."):
        return _NAMES.get(text[len("torch."):], text)
    try:
        return _NAMES.get(jnp.dtype(dtype).name, jnp.dtype(dtype).name)
    except TypeError:
        return text


def torch_dtype(dtype):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype if dtype in _NAMES.values() else dtype_name(jnp.dtype(dtype).name)
    return {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}[name]


def import_jax_triton():
    """Import jax_triton without letting it disable Triton's cache for everyone else.

    jax-triton 0.3.1 sets ``os.environ["TRITON_CACHE_DIR"] = ""`` at import (it compiles through its
    own path and needs no cache). Triton's own launcher, which the torch twins use in the same
    process, then fails with "Could not create or locate cache dir" (seen on the H200), and so would
    torch.compile. The previous value is restored right after the import.
    """
    import os

    had, previous = "TRITON_CACHE_DIR" in os.environ, os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if had:
        os.environ["TRITON_CACHE_DIR"] = previous
    else:
        os.environ.pop("TRITON_CACHE_DIR", None)
    return jax_triton


def jax_launch(kernel, inputs: Sequence[Any], out_shapes, grid, *, num_warps: int,
               num_stages: int, enable_fp_fusion: bool = True, **constexprs):
    """Launch `kernel` from JAX. `inputs` are arrays then Python scalars, in kernel order.
    enable_fp_fusion=False: no mul+add contraction (LLVM contract off, ptxas --fmad=false)."""
    jt = import_jax_triton()

    return jt.triton_call(*inputs, kernel=kernel, out_shape=out_shapes, grid=grid,
                          num_warps=num_warps, num_stages=num_stages,
                          enable_fp_fusion=enable_fp_fusion, **constexprs)


def torch_launch(kernel, inputs: Sequence[Any], outputs: Sequence[Any], grid, *, num_warps: int,
                 num_stages: int, enable_fp_fusion: bool = True, **constexprs):
    """Launch the same `kernel` on torch tensors (outputs preallocated by the caller)."""
    kernel[grid](*inputs, *outputs, num_warps=num_warps, num_stages=num_stages,
                 enable_fp_fusion=enable_fp_fusion, **constexprs)
    return outputs


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: Triton runs the same source on CPU tensors with numpy. The
    CPU tests use it to check a kernel's logic (masks, tiles, schedules), not the GPU's bits."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def require_cuda_tensors(name: str, *tensors) -> None:
    if interpreting():
        return
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if not t.is_cuda:
            raise ValueError(f"{name}: argument {i} is on {t.device}; the Triton leaves need CUDA "
                             "tensors (on the CPU use the JAX leaves' torch twins)")


def contiguous(t):
    return t if t is None or t.is_contiguous() else t.contiguous()


def bits(a) -> np.ndarray:
    """Raw float bits of a jax/numpy/torch array as unsigned ints (-0.0 != +0.0, NaN caught)."""
    if hasattr(a, "detach"):  # torch
        import torch

        t = a.detach().cpu().contiguous()
        view = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
                torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype]
        signed = t.view(view).numpy()
        return signed.view({np.int16: np.uint16, np.int32: np.uint32,
                            np.int64: np.uint64}[signed.dtype.type])
    arr = np.asarray(jax.device_get(a))
    return arr.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[arr.dtype.itemsize])
