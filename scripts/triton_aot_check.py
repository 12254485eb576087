"""Compile the engine's Triton launches (scripts/triton_launches.py: GEMM, routed experts,
attention, RoPE + KV write, MLA attention, norm, SiLU) for sm_90 (H200) on a machine without a GPU.

    python scripts/triton_aot_check.py [LABEL_PREFIX]
    python scripts/triton_aot_check.py --same-float-ops
    python scripts/triton_aot_check.py --rope-attention

Triton's compiler and ptxas run on any Linux x86_64 host, so a kernel that does not compile for the
H200 (an unsupported construct, a type mismatch between selected pointers) fails here, in CI, and
not in a device call. It checks compilation only: no bits and no timings (those need the GPU:
scripts/gpu_validate.py, jengine bench). Prints one line per kernel; exits 1 on the first failure.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-aot-"))

from triton_launches import (attention_kernels, gemm_kernels, mla_attention_kernels,  # noqa: E402
                             moe_kernels, norm_kernels, rope_attention_kernels)

H200 = (90, 32)  # compute capability 9.0, warp size 32


def _compile(fn, args: dict, consts: dict, num_warps: int, num_stages: int,
             enable_fp_fusion: bool = True, maxnreg: int | None = None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # In the kernel's parameter order (the constexprs' indices are positions): a scalar given in
    # `consts` is specialized, as jax-triton specializes a scalar argument equal to 1.
    signature = {name: args.get(name, "constexpr") for name in fn.arg_names}
    names = list(signature)
    # Array arguments 16-byte aligned, as jax-triton declares every array (XLA's buffers are) and
    # Triton's launcher finds torch's: without it Triton cannot use async copies, does not
    # pipeline the K loop, and this check would compile a kernel with one stage's shared memory
    # instead of num_stages' -- missing exactly the overflow it exists to catch.
    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(args.items())
               if kind.startswith("*")}
    src = ASTSource(fn=fn, signature=signature, attrs=aligned,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", *H200),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       enable_fp_fusion=enable_fp_fusion, maxnreg=maxnreg))


# A float instruction of the PTX (predicated or not): its opcode with its types and rounding.
_FLOAT_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:w?gmma|mma)[\w.]*|(?:fma|add|sub|mul|div|max|min|"
                       r"ex2|lg2|rcp|sqrt|neg|abs|cvt|selp|setp)[\w.]*f(?:16|32|64)[\w.]*)")


def float_ops(ptx: str) -> list[str]:
    """The float instructions of a kernel's PTX, in order, opcodes only (operands are register
    names the compiler picks). Two launches with the same list run the same arithmetic in the
    same order; a change to where operands are loaded from shows up nowhere in it."""
    return [m.group(1) for m in map(_FLOAT_OP.match, ptx.splitlines()) if m]


def same_float_ops() -> int:
    """--same-float-ops: the attention launches with the page ids per split, as the leaf plans
    them, against the same launches with the page ids per tile: the same float instructions in
    the same order (only the K/V addresses' source, the pipelining and registers differ)."""
    launches = {label: rest for label, *rest in attention_kernels()}
    failures = 0
    for label, (fn, args, consts, options) in launches.items():
        if not label.endswith(" pages"):
            continue
        base = label[:-len(" pages")]
        ops = [float_ops(_compile(f, a, c, *o).asm["ptx"])
               for f, a, c, o in (launches[base], (fn, args, consts, options))]
        same = ops[0] == ops[1]
        failures += not same
        print(f"{'same' if same else 'DIFF'}  {label} vs {base}: {len(ops[0])} / {len(ops[1])} "
              "float instructions")
    return 1 if failures else 0


def ptxas_usage(ptx: str, enable_fp_fusion: bool = False) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) per thread: ptxas -v on the PTX, as
    Triton's own compile runs it (triton's bundled ptxas, sm_90a, --fmad=false without fp
    fusion)."""
    import subprocess

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "kernel.cubin")]
        log = subprocess.run(cmd + ([] if enable_fp_fusion else ["--fmad=false"]),
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def float_ops_of_lines(ptx: str, path: str, lines) -> list[str]:
    """The float instructions of the PTX that its line info (.loc) puts on `lines` of the source
    file `path`: a helper's own arithmetic, wherever the compiler inlined it."""
    files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M))
    here, ops = None, []
    for line in ptx.splitlines():
        loc = re.match(r"^\s*\.loc\s+(\d+)\s+(\d+)", line)
        if loc:
            here = (files.get(loc.group(1), ""), int(loc.group(2)))
            continue
        op = _FLOAT_OP.match(line)
        if op and here and os.path.realpath(here[0]) == os.path.realpath(path) \
                and here[1] in lines:
            ops.append(op.group(1))
    return ops


def rope_attention_report() -> int:
    """--rope-attention: each fused launch of rope_attention_kernels() against the split launch
    it replaces (registers and spills, ptxas -v) and against rope_write_kernel: the float
    instructions on the lines of the shared `rope` helper. The fused launch must rotate with
    exactly rope_write's operations -- the same opcodes in the same proportions, no fma (fp
    fusion off). Exits 1 otherwise. Registers and spills are reported, not judged (they cost time,
    not bits)."""
    import inspect
    from collections import Counter

    from pallas_kernels import _triton_rope_write_kernels as RW

    body, first = inspect.getsourcelines(RW.rope.fn)
    path, lines = inspect.getsourcefile(RW.rope.fn), range(first, first + len(body))
    rope_write = {label.split()[4]: (fn, args, consts, opts)  # by dtype, the 8B heads
                  for label, fn, args, consts, opts in attention_kernels()
                  if label.startswith("rope_write hq=32") and not label.endswith("qkv")}
    reference = {}
    for dtype, (fn, args, consts, opts) in rope_write.items():
        ptx = _compile(fn, args, consts, *opts).asm["ptx"]
        reference[dtype] = Counter(float_ops_of_lines(ptx, path, lines))
        print(f"rope_write hq=32 {dtype}: rope ops {dict(reference[dtype])}, "
              f"{ptxas_usage(ptx)[0]} registers")
    failures, split = 0, None
    for label, fn, args, consts, opts in rope_attention_kernels():
        ptx = _compile(fn, args, consts, *opts).asm["ptx"]
        regs, stores, loads = ptxas_usage(ptx, opts[2])
        usage = f"{regs} registers, spills {stores} / {loads} B"
        if label.endswith(" split"):
            split = usage
            continue
        ops = per_element(Counter(float_ops_of_lines(ptx, path, lines)))
        ref = per_element(reference[label.split()[4]])
        # the same operations per element: counts in the same proportions (the launches rotate
        # other numbers of elements per thread), and no contraction among them
        same = set(ops) == set(ref) and not any("fma" in op for op in ops) and all(
            ops[op] * sum(ref.values()) == ref[op] * sum(ops.values()) for op in ref)
        failures += not same
        print(f"{'same' if same else 'DIFF'}  {label}: rope ops per element "
              f"{_ratios(ops)} (rope_write: {_ratios(ref)}); {usage} (the split launch: {split})")
    return 1 if failures else 0


def per_element(ops) -> dict:
    """Float op counts per element: a packed bf16x2 op counts for two elements, as two ops."""
    out = {}
    for op, n in ops.items():
        name, lanes = (op.replace("bf16x2", "bf16"), 2) if "bf16x2" in op else (op, 1)
        out[name] = out.get(name, 0) + n * lanes
    return out


def _ratios(ops: dict) -> str:
    least = min(ops.values())
    return ", ".join(f"{op} x{n / least:g}" for op, n in sorted(ops.items()))


def main(only: str = "") -> int:
    """only: compile just the launches whose label starts with it (e.g. "mla")."""
    failures = 0
    launches = [(label, fn, args, consts,
                 (tile.num_warps, tile.num_stages, True) if tile else (4, 1, True))
                for label, fn, args, consts, tile in [*gemm_kernels(), *moe_kernels()]]
    for label, fn, args, consts, options in (
            launches + list(attention_kernels()) + list(mla_attention_kernels())
            + list(norm_kernels())):
        if only and not label.startswith(only):
            continue
        try:
            t0 = time.perf_counter()
            kernel = _compile(fn, args, consts, *options)
            # the seconds: a first step that compiles slowly on the GPU may be a kernel's ptxas
            print(f"ok    {label}: {kernel.metadata.shared} B shared, compiled in "
                  f"{time.perf_counter() - t0:.1f} s")
        except Exception as exc:  # noqa: BLE001 - report which kernel and why, then fail
            failures += 1
            print(f"FAIL  {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--same-float-ops"]:
        sys.exit(same_float_ops())
    if sys.argv[1:2] == ["--rope-attention"]:
        sys.exit(rope_attention_report())
    sys.exit(main(*sys.argv[1:2]))
