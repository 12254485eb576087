"""Run Triton kernels on the CPU with Triton's interpreter (TRITON_INTERPRET=1), for logic checks.

The interpreter executes a kernel's source with numpy, so it checks masks, tiling, loop bounds and
that two schedules compute the same thing -- not the GPU's bits (those are checked on the H200 by
scripts/gpu_validate.py). Import this module before any @triton.jit source is imported: the
interpreter is chosen when the decorator runs.
"""

from __future__ import annotations

import importlib.util
import os

AVAILABLE = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None

if AVAILABLE:
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter as _interp

    _original = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        # Triton 3.6's interpreter keeps scalars as 1-element arrays and converts them with int(),
        # which numpy >= 2.4 refuses for arrays of ndim 1 (a loop bound loaded from memory then
        # fails). .item() is the same value.
        _original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

    _interp._patch_lang_tensor = _patch_lang_tensor


def _fixed_order_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """tl.dot as k = 0..K-1 accumulated in order with numpy's elementwise f32 ops (IEEE, no FMA).

    The interpreter's own dot is np.matmul: BLAS (or numpy's SIMD loop) picks its kernel by CPU
    feature and M, N, so a row's bits could depend on the processor and on the row's place in the
    tile (seen on an AVX2-only machine). Here every output element is the same sequence of IEEE
    operations wherever it sits, on any x86 or ARM CPU.
    """
    from triton.runtime.interpreter import TensorHandle, _convert_float
    import triton.language as tl
    import numpy as np

    def widen(t):
        data = t.data
        if t.dtype.scalar == tl.bfloat16 or (t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating()):
            data = _convert_float(data, t.dtype.scalar, tl.float32, None).view(np.float32)
        return data.astype(d.data.dtype)

    a_data, b_data = widen(a), widen(b)
    acc = np.array(d.data, copy=True)
    for k in range(a_data.shape[-1]):
        acc = acc + a_data[..., :, k:k + 1] * b_data[..., k:k + 1, :]
    return TensorHandle(acc, d.dtype.scalar)


if AVAILABLE:
    _interp.InterpreterBuilder.create_dot = _fixed_order_dot


def _get_bf16(self, value):
    """A bf16 constant (the interpreter has none: `x * -1.0` or `tl.where(m, x, 0.0)` on a bf16 x
    raised). bf16 values are kept as their uint16 bits; the constants kernels use (0, +-1) are
    exact, so the f32 value's top half is the bf16 value."""
    from triton.runtime.interpreter import TensorHandle
    import triton.language as tl
    import numpy as np

    bits = np.array([value], dtype=np.float32).view(np.uint32) >> 16
    return TensorHandle(bits.astype(np.uint16), tl.bfloat16)


def _bf16_aware(op):
    """The interpreter's float op `op`, with bf16 operands (kept as uint16 bits, which numpy
    would add or multiply as integers) widened to f32, computed and narrowed back with the
    interpreter's own conversions -- a logic check's arithmetic, not the GPU's rounding."""
    def binary(self, lhs, rhs):
        from triton.runtime.interpreter import TensorHandle, _convert_float
        import triton.language as tl
        import numpy as np

        if lhs.dtype.scalar != tl.bfloat16:
            return _plain[op](self, lhs, rhs)
        wide = [_convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
                for h in (lhs, rhs)]
        out = _NUMPY[op](*wide).astype(np.float32)
        narrow = _convert_float(out, tl.float32, tl.bfloat16, None).view(np.uint16)
        return TensorHandle(narrow.reshape(out.shape), tl.bfloat16)
    return binary


if AVAILABLE:
    import numpy as _np

    _NUMPY = {"create_fadd": _np.add, "create_fsub": _np.subtract, "create_fmul": _np.multiply,
              "create_fdiv": _np.divide}
    _plain = {name: getattr(_interp.InterpreterBuilder, name) for name in _NUMPY}
    for _name in _NUMPY:
        setattr(_interp.InterpreterBuilder, _name, _bf16_aware(_name))
    _interp.InterpreterBuilder.get_bf16 = _get_bf16


def registered_as_on_a_gpu(monkeypatch, module, leaves):
    """For a fixture (`yield from`): reload a Triton leaf module as on a GPU machine with
    jax-triton (here it is missing), so it registers its leaves; yield the module; then take
    `leaves` ((family, name, impl), ...) out of the registry and reload the module as it was.
    What the engine and the trainer's twin table would plan on a GPU."""
    from pallas_kernels import _triton_launch
    from pallas_kernels.registry import REGISTRY

    for family, name, impl in leaves:
        assert not any(l.impl == impl for l in REGISTRY.leaves(family, name)), (family, name, impl)
    monkeypatch.setattr(_triton_launch, "triton_available", lambda: True)
    yield importlib.reload(module)
    for family, name, impl in leaves:
        REGISTRY.unregister(family, name, impl)
    monkeypatch.undo()
    importlib.reload(module)


def triton_gemm_leaves():
    """The (family, name, impl) leaves pallas_kernels/triton_gemm.py registers on a GPU."""
    return [(family, name, impl) for family, name in (("linear", "gemm"), ("linear", "gemm_group"))
            for impl in ("triton_fixed_tile", "xla_gate_up_triton")]


def run_smoke(script: str, out_dir, name: str) -> list:
    """Run scripts/<script> --smoke (its bits part under this interpreter, in a subprocess: the
    interpreter is chosen before any kernel source is imported) and return the rows of the
    <name>.json it writes to out_dir; the script's own exit status must be 0."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", script), "--smoke",
                           "--out", str(out_dir)], capture_output=True, text=True, cwd=root,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(os.path.join(str(out_dir), f"{name}.json")) as f:
        return json.load(f)
