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
