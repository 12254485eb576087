"""The twin table: for each operation trainer mode routes, the torch callable that gives the engine's bits.

A *twin* is the torch-callable form of a batch-invariant leaf in ``pallas_kernels``: on the CPU the
leaf's own compiled XLA program run on torch tensors through DLPack (``pallas_kernels._twin``), on a
GPU the same Triton source launched from torch. The table is not written per device: it is planned
from the kernel registry exactly as the engine plans its model (``plan(family, name, hardware=...,
features={"batch_invariant"})``), and each planned leaf's twin is looked up next to the leaf:

* ``leaf.fn.torch_twin`` if the leaf function carries one, else
* ``<leaf function name>_torch`` in the leaf's module (``gemm_triton`` -> ``gemm_triton_torch``), else
* a callable in the leaf's module whose ``__wrapped__`` is the leaf function (what
  ``pallas_kernels._twin.torch_twin`` and ``functools.wraps`` produce), else
* planning the twin table fails, naming the leaf: a leaf without a twin cannot be aligned to.

The RMSNorm leaf is a composite (mean of squares, rsqrt, multiplies) while the trainer's HF forward
runs it op by op, so trainer mode needs the twins of its parts: ``mean_fixed_order_torch`` (the
fixed-order halving-tree mean over the last axis) and ``rsqrt_torch``, from the planned leaf's
module when it defines them, else from pallas_kernels.rmsnorm (XLA through DLPack). The Triton norm
defines its mean (the kernel's tree and div_rn: XLA's division on the GPU is not the kernel's); its
rsqrt is XLA's, libdevice's as the kernel's. Elementwise transcendental
functions that are not leaves (cos, sin, pow, exp, log) are routed to XLA's own implementation
through DLPack on every device, which is what the engine runs for its RoPE tables and logprobs.
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_kernels._twin import torch_twin
from pallas_kernels.registry import plan

# Importing the leaf modules registers their leaves.
import pallas_kernels.activation  # noqa: F401
import pallas_kernels.attention  # noqa: F401
import pallas_kernels.gemm  # noqa: F401
import pallas_kernels.logprobs  # noqa: F401
import pallas_kernels.mla_attention  # noqa: F401
import pallas_kernels.moe_router  # noqa: F401
import pallas_kernels.moe_router_grouped  # noqa: F401
import pallas_kernels.rmsnorm  # noqa: F401

REQUIRED_FEATURES = frozenset({"batch_invariant"})

# (family, name) of every leaf whose twin trainer mode needs.
LEAF_OPERATORS = {
    "gemm": ("linear", "gemm"),
    "rmsnorm": ("norm", "rmsnorm"),
    "silu": ("activation", "silu"),
    "attention": ("attention", "dense_causal"),
    "mla_attention": ("attention", "mla_dense_causal"),
    "block_sumexp": ("sampling", "block_sumexp"),
    "router_topk": ("moe", "router_topk"),
    "router_grouped_topk": ("moe", "router_grouped_topk"),
}

# Features an operator requires beyond batch invariance: the trainer's router is torch's topk, so its
# twin is the leaf with PyTorch CUDA's tie order (what --router-topk torch plans in the engine).
LEAF_FEATURES = {"router_topk": pallas_kernels.moe_router.ROUTER_TOPK_FEATURES["torch"],
                 "router_grouped_topk": pallas_kernels.moe_router.ROUTER_TOPK_FEATURES["torch"]}

# Operators whose leaves take f32 whatever the model's format.
F32_FAMILIES = ("sampling", "moe")

# Parts of the RMSNorm leaf that HF's forward calls as separate torch ops.
RMSNORM_PART_TWINS = ("mean_fixed_order_torch", "rsqrt_torch")


class TwinError(RuntimeError):
    """A leaf has no torch twin, or the environment cannot give the twins the engine's bits."""


# XLA:CPU evaluates exp and log on a 1-D array of 3, 5, 6, 7, 11, 13, 14 or 15 elements with a
# different code path (a vector tail) whose bits differ from the bulk path in ~9 % of elements;
# longer arrays and multi-dimensional ones take the bulk path everywhere (measured, jaxlib 0.10.2).
# The engine always runs them on bulk shapes, so a twin flattens its input and pads it to a multiple
# of PAD_MULTIPLE elements: every element then gets the bulk path's bits, whatever the torch shape.
PAD_MULTIPLE = 16


def _xla_elementwise(fn: Callable, **jit_kwargs) -> Callable:
    """Twin of an elementwise XLA function over tensors of any shape (bulk-path bits)."""
    twin = torch_twin(fn, **jit_kwargs)

    def padded(*tensors, **static):
        import torch

        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        n = 1
        for dim in shape:
            n *= dim
        width = max(PAD_MULTIPLE, -(-n // PAD_MULTIPLE) * PAD_MULTIPLE)
        flat = []
        for t in tensors:
            f = t.broadcast_to(shape).reshape(-1)
            flat.append(torch.cat([f, f.new_ones(width - n)]) if width != n else f.contiguous())
        return twin(*flat, **static)[:n].reshape(shape)

    return padded


def _pow_tensor_scalar(x, exponent):
    # The exponent stays a weak-typed Python scalar, as in the engine's `x ** 2.0`-style code.
    return jnp.power(x, exponent)


def _pow_scalar_tensor(exponent, *, base):
    # pow(scalar, tensor): the engine writes `jnp.float32(theta) ** exponent` (rope.py).
    return jnp.power(jnp.asarray(base, exponent.dtype), exponent)


# XLA's elementwise functions, jitted once and called through DLPack on any device.
XLA_ELEMENTWISE = {
    "cos": _xla_elementwise(jnp.cos),
    "sin": _xla_elementwise(jnp.sin),
    "exp": _xla_elementwise(jnp.exp),
    "log": _xla_elementwise(jnp.log),
    "pow_tensor_tensor": _xla_elementwise(jnp.power),
    "pow_scalar_tensor": _xla_elementwise(_pow_scalar_tensor, static_argnames=("base",)),
    "pow_tensor_scalar": _xla_elementwise(_pow_tensor_scalar, static_argnames=("exponent",)),
}


def hardware_for(device: str) -> str:
    """Registry hardware name for a torch device string ("cpu", "cuda", "cuda:1")."""
    kind = device.split(":")[0]
    if kind == "cpu":
        return "cpu"
    if kind == "cuda":
        import torch

        major, _ = torch.cuda.get_device_capability(torch.device(device))
        return "gpu-sm90" if major >= 9 else "gpu"
    raise TwinError(f"--device={device!r} is not supported (supported: cpu, cuda)")


def find_twin(leaf_fn: Callable, module_name: str | None = None) -> Callable | None:
    """The torch twin of a leaf function (see the module docstring for the lookup rule)."""
    twin = getattr(leaf_fn, "torch_twin", None)
    if callable(twin):
        return twin
    module = sys.modules.get(module_name or leaf_fn.__module__)
    if module is None:
        module = importlib.import_module(module_name or leaf_fn.__module__)
    named = getattr(module, f"{getattr(leaf_fn, '__name__', '')}_torch", None)
    if callable(named):
        return named
    for value in vars(module).values():
        if callable(value) and getattr(value, "__wrapped__", None) is leaf_fn:
            return value
    return None


@dataclass(frozen=True)
class TwinTable:
    """Every torch callable trainer mode routes to, planned for one device."""

    device: str
    hardware: str
    gemm: Callable[..., Any]  # (x[M,K], w[K,N], bias[N] | None, *, out_dtype) -> [M,N]
    rmsnorm: Callable[..., Any]  # (x, weight, *, eps)
    mean_last: Callable[..., Any]  # (x) -> mean over the last axis, keepdim
    rsqrt: Callable[..., Any]
    silu: Callable[..., Any]
    attention: Callable[..., Any]  # (q, k, v [B,S,H,D], *, scale) -> [B,S,Hq,D]
    block_sumexp: Callable[..., Any]  # (shifted f32[R,V], *, block_size) -> f32[R, V // block]
    router_topk: Callable[..., Any]  # (logits f32[T,E], *, k, norm_topk_prob) -> (ids, weights)
    # (logits f32[T,E], bias f32[E], *, k, n_group, topk_group, norm_topk_prob,
    #  routed_scaling_factor, score) -> (ids, weights)
    router_grouped_topk: Callable[..., Any]
    mla_attention: Callable[..., Any]  # (q [B,S,H,W], latent [B,S,W], *, v_width, scale)
    elementwise: dict[str, Callable[..., Any]] = field(default_factory=dict)
    provenance: dict[str, str] = field(default_factory=dict)  # op -> where its twin comes from

    def describe(self) -> str:
        return "\n".join(f"  {op:18s} {src}" for op, src in self.provenance.items())


@functools.lru_cache(maxsize=None)
def plan_twin_table(device: str = "cpu", fmt: str = "bf16") -> TwinTable:
    """Plan the batch-invariant leaves for ``device`` and the model format ``fmt`` ("bf16" or
    "f32"), as the engine plans its model, and collect their torch twins."""
    if fmt not in ("bf16", "f32"):
        raise TwinError(f"model format {fmt!r} is not supported (bf16 or f32)")
    hardware = hardware_for(device)
    twins: dict[str, Callable] = {}
    provenance: dict[str, str] = {}
    for op, (family, name) in LEAF_OPERATORS.items():
        formats = {"f32"} if family in F32_FAMILIES else {fmt}
        p = plan(family, name, formats=formats, hardware=hardware,
                 features=REQUIRED_FEATURES | LEAF_FEATURES.get(op, frozenset()))
        twin = find_twin(p.leaf.fn)
        if twin is None:
            raise TwinError(
                f"the planned leaf {family}.{name} -> {p.leaf.impl} ({p.leaf.fn.__module__}) has no "
                "torch twin: give the leaf function a `torch_twin` attribute or define "
                "`<name>_torch = pallas_kernels._twin.torch_twin(<leaf>)` next to it")
        twins[op] = twin
        provenance[op] = f"{p.leaf.fn.__module__}.{getattr(twin, '__name__', op)} " \
                         f"(twin of {family}.{name} -> {p.leaf.impl})"
        if op == "rmsnorm":
            for part in RMSNORM_PART_TWINS:
                module = sys.modules[p.leaf.fn.__module__]
                if not callable(getattr(module, part, None)):
                    module = pallas_kernels.rmsnorm
                key = "mean_last" if part.startswith("mean") else "rsqrt"
                twins[key] = getattr(module, part)
                provenance[key] = f"{module.__name__}.{part} (part of norm.rmsnorm -> {p.leaf.impl})"
    for op in XLA_ELEMENTWISE:
        provenance[op] = f"jax.numpy via DLPack ({jax.default_backend()} XLA)"
    return TwinTable(device=device, hardware=hardware, elementwise=dict(XLA_ELEMENTWISE),
                     provenance=provenance, **twins)
