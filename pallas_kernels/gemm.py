"""("linear", "gemm"): every dense projection and the LM head.

Signature: ``fn(x[M, K], w[K, N], bias=None, *, out_dtype) -> [M, N]``, f32 accumulation, an optional
f32 bias added to the accumulator, one rounding to ``out_dtype``.

* ``xla_native`` — XLA's autotuned dot. Fast, and batch-variant: a row's bits change with M on CPU
  and GPU under every flag measured (platform-facts.md). Served only when nothing is required.
* ``fixed_order`` — k = 0..K-1 accumulated in order for each output element (elementwise ops only),
  so a row's bits never depend on M. Declares the ``batch_invariant`` feature. Slow; it exists to be
  provably right on any backend (the GPU's fast invariant form is ``triton_gemm``).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._twin import torch_twin
from pallas_kernels.fixed_order import sequential_dot
from pallas_kernels.registry import Priority, register

FORMATS = {"bf16", "f32"}


@register("linear", "gemm", "xla_native", formats=FORMATS, hardware={"any"},
          priority=Priority.TUNED + 1, traits={"batch_invariant": False})
def gemm_xla_native(x, w, bias=None, *, out_dtype):
    acc = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)


@register("linear", "gemm", "fixed_order", formats=FORMATS, hardware={"any"},
          priority=Priority.PORTABLE, traits={"deterministic": True, "batch_invariant": True},
          features={"batch_invariant"})
def gemm_fixed_order(x, w, bias=None, *, out_dtype):
    return sequential_dot(x, w, bias).astype(out_dtype)


# The trainer-side twin: the same compiled program, called from torch (pallas_kernels/_twin.py).
gemm_fixed_order_torch = torch_twin(gemm_fixed_order, static_argnames=("out_dtype",))
