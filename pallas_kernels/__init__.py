"""Kernel leaves and their registry.

Importing the package registers every in-tree leaf. The portable modules come first: each declares
its families' signatures, which the Triton leaves of the same families are checked against. The
Triton leaves register only where triton and jax-triton import and a GPU is present; elsewhere their
modules import and register nothing.
"""

from pallas_kernels import registry  # noqa: F401
from pallas_kernels._triton_launch import counter_chain  # noqa: F401  (a model step's scope)
from pallas_kernels import (activation, attention, gemm, logprobs, mla_attention,  # noqa: F401
                            moe_grouped_gemm, moe_router, moe_router_grouped, rmsnorm, rope_write,
                            sampling)
from pallas_kernels import gemm_epilogues  # noqa: F401  (after gemm, rmsnorm, activation)
from pallas_kernels import rope_attention  # noqa: F401  (after attention, rope_write, gemm_epilogues)
from pallas_kernels import (triton_activation, triton_attention, triton_gemm,  # noqa: F401
                            triton_gemm_add_norm, triton_gemm_swiglu, triton_mla_attention,
                            triton_moe_grouped_gemm, triton_norm, triton_rope_attention,
                            triton_rope_write, triton_sampling)
