"""("linear", "gemm") and ("linear", "gemm_group"): every dense projection and the LM head.

``gemm`` computes one projection: f32 accumulation, an optional f32 bias added to the accumulator,
one rounding to ``out_dtype``.

* ``xla_native`` — XLA's autotuned dot. Fast, and batch-variant: a row's bits change with M on CPU
  and GPU under every flag measured (platform-facts.md). Served only when nothing is required.
* ``fixed_order`` — k = 0..K-1 accumulated in order for each output element (elementwise ops only),
  so a row's bits never depend on M. Declares the ``batch_invariant`` feature. Slow; it exists to be
  provably right on any backend (the GPU's fast invariant form is ``triton_gemm``).

``gemm_group`` computes several projections of one x (q/k/v, gate/up), each output with the bits of
its own ``gemm`` call by the leaf of the same impl name, so a model may group its projections while
the trainer keeps them separate. Each gemm leaf has a grouped leaf with the same name, formats,
hardware, priority, traits and features: one request plans corresponding leaves of both families.
The portable grouped leaves make one gemm call per member; the Triton one (triton_gemm.py) makes one
launch for the whole group. One pair makes no bit claim, as --numerics auto asks none:
``xla_gate_up_triton`` (triton_gemm.py, GPUs only, planned by auto above ``xla_native``) is XLA's
dot, except that the MLP's gate/up at decode rows runs the Triton grouped launch.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._twin import torch_twin
from pallas_kernels.fixed_order import sequential_dot
from pallas_kernels.registry import Priority, declare_family, register

FORMATS = {"bf16", "f32"}


def _gemm_signature(x, w, bias=None, *, out_dtype):
    """x[M, K], w[K, N] (one dtype), bias[N] or None -> [M, N] in out_dtype, f32 accumulation."""


def _gemm_group_signature(x, ws, biases=None, *, out_dtype):
    """x[M, K], ws tuple of [K, N_i], biases tuple of [N_i] or None -> tuple of [M, N_i]."""


declare_family("linear", "gemm", _gemm_signature)
declare_family("linear", "gemm_group", _gemm_group_signature)

XLA_NATIVE = dict(formats=FORMATS, hardware={"any"}, priority=Priority.TUNED + 1,
                  traits={"batch_invariant": False})
# width_invariant: an output element's bits do not depend on how many columns (N) share the call,
# so a column-parallel shard computes the one-device value (docs/parallelism.md, topology).
FIXED_ORDER = dict(formats=FORMATS, hardware={"any"}, priority=Priority.PORTABLE,
                   traits={"deterministic": True, "batch_invariant": True,
                           "width_invariant": True},
                   features={"batch_invariant"})


@register("linear", "gemm", "xla_native", **XLA_NATIVE)
def gemm_xla_native(x, w, bias=None, *, out_dtype):
    if bias is None:
        # The dot writes out_dtype itself (f32 accumulation, one rounding, as below): asked for
        # f32 and then converted, XLA left cuBLAS's GEMMs writing f32 and ran the conversion as a
        # kernel of its own -- on the H200, 64 conversions of 82 us per 4096-token prefill chunk
        # of an 8B model (gate / up; 5.3 of 131 ms), and every f32 output written twice as wide.
        return jnp.dot(x, w, preferred_element_type=out_dtype)
    acc = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return (acc + bias.astype(jnp.float32)).astype(out_dtype)


@register("linear", "gemm", "fixed_order", **FIXED_ORDER)
def gemm_fixed_order(x, w, bias=None, *, out_dtype):
    return sequential_dot(x, w, bias).astype(out_dtype)


def one_call_per_member(gemm_fn):
    """The grouped form of a gemm leaf that has no launch of its own: one `gemm_fn` call each."""

    def gemm_group(x, ws, biases=None, *, out_dtype):
        return tuple(gemm_fn(x, w, None if biases is None else biases[i], out_dtype=out_dtype)
                     for i, w in enumerate(ws))

    gemm_group.__name__ = gemm_group.__qualname__ = f"{gemm_fn.__name__}_group"
    return gemm_group


gemm_group_xla_native = register("linear", "gemm_group", "xla_native",
                                 **XLA_NATIVE)(one_call_per_member(gemm_xla_native))
gemm_group_fixed_order = register("linear", "gemm_group", "fixed_order",
                                  **FIXED_ORDER)(one_call_per_member(gemm_fixed_order))

# The trainer-side twin: the same compiled program, called from torch (pallas_kernels/_twin.py).
gemm_fixed_order_torch = torch_twin(gemm_fixed_order, static_argnames=("out_dtype",))
