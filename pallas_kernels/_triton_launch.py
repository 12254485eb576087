"""Shared plumbing of the Triton leaves: availability, dtype names, and the two launchers.

Every Triton leaf is one `@triton.jit` source (pallas_kernels/_triton_*kernels.py) with two hosts:
`jax_launch` goes through jax-triton's `triton_call` (an XLA custom call), `torch_launch` through
Triton's own launcher on torch tensors. Both pass the same constexprs, num_warps, num_stages and
register bound (maxnreg), so they compile the same program.

Nothing here imports triton, jax_triton or torch at module import: the CPU machines have none of
the first two, and serving never needs torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The batch-invariant leaf declaration every Triton leaf makes (registry.py: traits vs features).
INVARIANT = dict(traits={"deterministic": True, "batch_invariant": True},
                 features={"batch_invariant"})


def _missing_triton_modules() -> list[str]:
    """Which of triton and jax_triton are not importable (checked without importing them)."""
    return [m for m in ("triton", "jax_triton") if importlib.util.find_spec(m) is None]


def triton_available() -> bool:
    """True when both triton and jax_triton are importable."""
    return not _missing_triton_modules()


def missing_gpu_leaves(hardware: str) -> str | None:
    """The warning a GPU launch gets when its Triton leaves cannot register (None otherwise).

    Without triton and jax-triton the families with Triton leaves plan portable jnp ones in their
    place: the same envelope, far slower at production shapes (on an H100 without jax-triton the
    bench's 8B shape ran auto's bs 1 decode step at 14.5 ms blocked on, against 7.4, and
    rl-bitwise's rows did not finish in the part's 160 s), so a launch says why."""
    missing = _missing_triton_modules()
    if not hardware.startswith("gpu") or not missing:
        return None
    return (f"hardware {hardware!r} but {' and '.join(missing)} not importable: the Triton leaves "
            "are not registered, so their families run portable jnp leaves instead, far slower "
            "at production shapes; install the gpu extra: pip install -e '.[gpu]'")


def kernels():
    """The shared @triton.jit sources (norm, SiLU, block_sumexp), imported on first use; the GEMM,
    attention and MLA leaves have their own modules (each leaf module's `kernels()`)."""
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


# jaxlib registers two custom-call targets for a compiled Triton kernel. jax-triton 0.3.1 emits the
# legacy one, "triton_kernel_call" (a status-returning custom call): XLA cannot put it in a command
# buffer (a CUDA graph), so each launch ends the graph before it (the tenth session's profile:
# rl-bitwise ran its ~600 kernels one by one, no graph at all). "triton_kernel_call_ffi" is
# jaxlib's typed-FFI handler for the same kernel proto (the one Pallas' Triton lowering uses, in
# every jaxlib we admit), declared command-buffer compatible; it takes the zlib-compressed proto as
# the attribute "opaque". Same PTX, same launch parameters: only the host side of the call changes
# (goldens unchanged under "ffi" on the H200, eleventh session, and "layers" on the H100,
# thirty-eighth).
# Which launches take which (JENGINE_TRITON_CALL):
# - "ffi", every launch: the whole decode step is one CUDA graph. Pipelined a little faster, but a
#   step blocked on is 1.4-3.5 ms slower (nothing runs until the host has updated and launched the
#   step's one graph) and the Engine workload loses (H100, thirtieth session: 4602 -> 4479 tok/s,
#   ITL p99 156 -> 298 ms).
# - "layers", the default since the thirty-eighth session: the attention launches (the ones that
#   read the step's own inputs -- positions, page tables -- and write the KV pages) stay legacy,
#   so they end a graph, and the rest (GEMMs, norms, activations) join XLA's command buffers: a
#   graph a layer, launched as the host reaches it. H100, rl-bitwise against "legacy": the Engine
#   workload 4760 -> 4850 and 4722 -> 4827 tok/s (its decode step at 64 rows 10.2 -> 9.9 ms), the
#   pipelined bs 1 step 6.79 -> 6.73, 6.82 -> 6.75 and 6.84 -> 6.78 ms; but a step blocked on is
#   0.45-0.9 ms slower at bs 1 (the host updates the graphs before they run), and the Engine with
#   overlap off 2-4 % slower. The gap after a Triton launch barely shrinks inside a graph, so
#   most of rl-bitwise's bs 1 idle is not the launch path (docs/performance.md, thirty-eighth).
# - "legacy", every launch on jax-triton's own call.
FFI_TARGET = "triton_kernel_call_ffi"
LEGACY_TARGET = "triton_kernel_call"
_ffi_lowering_registered = False


# Name parts of the launches "layers" keeps on the legacy call.
GRAPH_ENDING_KERNELS = ("attention", "rope", "mla")


def custom_call_target(kernel_name: str = "") -> str:
    """The custom-call target a JAX launch of `kernel_name` uses, as JENGINE_TRITON_CALL says
    (see above): "layers" (the default: the attention launches on jax-triton's legacy call, the
    rest on the command-buffer-compatible one), "ffi" (every launch on that) or "legacy"."""
    import os

    choice = os.environ.get("JENGINE_TRITON_CALL", "layers")
    if choice not in ("ffi", "layers", "legacy"):
        raise ValueError(f"JENGINE_TRITON_CALL={choice!r}: expected 'ffi', 'layers' or 'legacy'")
    if choice == "layers":
        ends_graph = any(part in kernel_name for part in GRAPH_ENDING_KERNELS)
        return LEGACY_TARGET if ends_graph else FFI_TARGET
    return FFI_TARGET if choice == "ffi" else LEGACY_TARGET


def restate_as_ffi(op):
    """Replace a lowered legacy Triton custom call `op` (its backend_config the compressed proto)
    by the same call to FFI_TARGET, the proto passed as the FFI attribute "opaque"; returns the new
    op. The new op is built by jax's own custom_call, so it is spelled as this jax version spells
    any typed-FFI call (as Pallas' does); layouts and aliases are carried over."""
    from jax._src.interpreters import mlir  # custom_call is not in the public module

    op = getattr(op, "operation", op)
    new = mlir.custom_call(FFI_TARGET, result_types=[r.type for r in op.results],
                           operands=list(op.operands),
                           backend_config={"opaque": op.attributes["backend_config"]})
    for name in ("operand_layouts", "result_layouts", "output_operand_aliases"):
        if name in op.attributes:
            new.operation.attributes[name] = op.attributes[name]
    op.erase()
    return new


# Triton's `maxnreg` (a launch's register bound, PTX .maxnreg): jax-triton 0.3.1 has no argument
# for it, so jax_launch carries it as the primitive parameter MAXNREG_PARAM, which our lowering
# takes off before jax-triton's own runs and compiles the kernel with a backend whose options add
# it. jax-triton's compile cache keys on neither, so a bounded launch compiles under a cache of its
# own bound (swapped in for the call, under a lock: two lowerings at once would see each other's).
MAXNREG_PARAM = "jengine_maxnreg"
_BOUNDED_CACHES: dict[int, dict] = {}
_LOWERING_LOCK = threading.RLock()


@contextlib.contextmanager
def _bounded_backend(lib, maxnreg: int | None):
    """jax-triton's CUDA backend factory, with `maxnreg` in every option set it parses."""
    if not maxnreg:
        yield lib.get_cuda_backend
        return

    def backend_init(device, compute_capability):
        backend = lib.get_cuda_backend(device, compute_capability)
        parse = backend.parse_options
        backend.parse_options = lambda options: parse({**options, "maxnreg": maxnreg})
        return backend

    shared = lib._COMPILED_KERNEL_CACHE
    lib._COMPILED_KERNEL_CACHE = _BOUNDED_CACHES.setdefault(maxnreg, {})
    try:
        yield backend_init
    finally:
        lib._COMPILED_KERNEL_CACHE = shared


def _lower(lib, ctx, *args, custom_call_target_name, **params):
    """jax-triton's lowering of one Triton call (`lib`: jax_triton.triton_lib), with the register
    bound the launch asks for (MAXNREG_PARAM); a call whose target is FFI_TARGET is lowered as a
    legacy one (jax-triton spells every call so), then restated as a typed-FFI one."""
    maxnreg = params.pop(MAXNREG_PARAM, None)
    ffi = custom_call_target_name == FFI_TARGET
    with _LOWERING_LOCK, _bounded_backend(lib, maxnreg) as backend_init:
        results = lib.triton_kernel_call_lowering(
            backend_init, ctx, *args,
            custom_call_target_name=LEGACY_TARGET if ffi else custom_call_target_name, **params)
    return restate_as_ffi(results[0].owner).results if ffi else results


def _register_ffi_lowering(jt) -> None:
    """Lower jax-triton's calls on CUDA through `_lower` (once per process)."""
    global _ffi_lowering_registered
    if _ffi_lowering_registered:
        return
    import functools

    from jax.interpreters import mlir

    lib = jt.triton_lib
    mlir.register_lowering(lib.triton_kernel_call_p, functools.partial(_lower, lib),
                           platform="cuda")
    _ffi_lowering_registered = True


class Counters:
    """A launch's arrival counters: `size` int32s that are zero when the kernel starts and that it
    leaves zero (`last_to_arrive` resets each one as its last program arrives). Passed as a
    launch's last input; the launcher appends the same buffer as the last output (the kernel gets
    both pointers and counts through the output's) and keeps it away from the caller's results.

    Why a buffer threaded from launch to launch instead of zeroing a fresh one per launch (what
    jax-triton's `zeroed_outputs` did): in an rl-bitwise decode step of an 8B model that was 128
    memsets, each its own operation on the stream between two kernels. Inside `counter_chain()`
    (the model step opens it) every counting launch takes the chain's buffer and hands back its
    aliased output, so the step zeroes one buffer once; outside a chain each launch gets fresh
    zeros, as before."""

    def __init__(self, size: int):
        self.size = int(size)


_CHAIN: contextvars.ContextVar[list | None] = contextvars.ContextVar("counter_chain",
                                                                     default=None)


@contextlib.contextmanager
def counter_chain():
    """Thread one counter buffer through every `Counters` launch traced inside (one trace: the
    step's body; a launch traced under another transformation inside it would leak a tracer, and
    JAX says so). The buffer grows -- a fresh zeroed one -- when a launch needs more counters."""
    token = _CHAIN.set([None])
    try:
        yield
    finally:
        _CHAIN.reset(token)


def _take_counters(size: int):
    box = _CHAIN.get()
    held = None if box is None else box[0]
    if held is not None and held.shape[0] >= size:
        return held
    return jnp.zeros((size,), jnp.int32)


def _give_counters(buffer) -> None:
    box = _CHAIN.get()
    if box is not None:
        box[0] = buffer


def jax_launch(kernel, inputs: Sequence[Any], out_shapes, grid, *, num_warps: int,
               num_stages: int, enable_fp_fusion: bool = True, maxnreg: int | None = None,
               input_output_aliases: dict[int, int] | None = None, **constexprs):
    """Launch `kernel` from JAX. `inputs` are arrays and Python scalars, in kernel order; a
    `Counters` may be the last (see there).
    enable_fp_fusion=False: no mul+add contraction (LLVM contract off, ptxas --fmad=false).
    maxnreg: a register bound (MAXNREG_PARAM says how it gets to the compiler).
    input_output_aliases: {array input index: output index}, an output that is its input's buffer
    (updated in place where XLA can donate it; the kernel gets both pointers)."""
    jt = import_jax_triton()
    _register_ffi_lowering(jt)
    inputs = list(inputs)
    counters = inputs[-1] if inputs and isinstance(inputs[-1], Counters) else None
    single = not isinstance(out_shapes, (tuple, list))
    outs = [out_shapes] if single else list(out_shapes)
    aliases = dict(input_output_aliases or {})
    if counters is not None:
        buffer = _take_counters(counters.size)
        inputs[-1] = buffer
        aliases[sum(not isinstance(a, (bool, int, float, np.floating)) for a in inputs) - 1] = \
            len(outs)
        outs.append(jax.ShapeDtypeStruct(buffer.shape, jnp.int32))
    if maxnreg:
        constexprs[MAXNREG_PARAM] = maxnreg
    results = jt.triton_call(*inputs, kernel=kernel, out_shape=tuple(outs), grid=grid,
                             num_warps=num_warps, num_stages=num_stages,
                             enable_fp_fusion=enable_fp_fusion, input_output_aliases=aliases,
                             custom_call_target_name=custom_call_target(_kernel_name(kernel)),
                             **constexprs)
    results = list(results)
    if counters is not None:
        _give_counters(results.pop())
    return results[0] if single else tuple(results)


def _kernel_name(kernel) -> str:
    return getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "")


def torch_launch(kernel, inputs: Sequence[Any], outputs: Sequence[Any], grid, *, num_warps: int,
                 num_stages: int, enable_fp_fusion: bool = True, maxnreg: int | None = None,
                 **constexprs):
    """Launch the same `kernel` on torch tensors (outputs preallocated by the caller). A last
    input `Counters` becomes a zeroed int32 tensor, passed as the last output too. maxnreg: a
    register bound (Triton's launcher takes it directly)."""
    inputs = list(inputs)
    extra = ()
    if inputs and isinstance(inputs[-1], Counters):
        import torch

        device = next(a.device for a in inputs if isinstance(a, torch.Tensor))
        inputs[-1] = torch.zeros(inputs[-1].size, dtype=torch.int32, device=device)
        extra = (inputs[-1],)
    bound = {"maxnreg": maxnreg} if maxnreg else {}
    kernel[grid](*inputs, *outputs, *extra, num_warps=num_warps, num_stages=num_stages,
                 enable_fp_fusion=enable_fp_fusion, **bound, **constexprs)
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
