"""The GEMM (every tile and by_m launch shape), the routed experts' grouped GEMM, attention
(auto's wide prefill tile too), rope_write, MLA attention, layer-boundary norm and SiLU kernels
compile for the H200 (sm_90), checked on the CPU by Triton's own compiler; and an attention
experiment that must keep every bit keeps every float instruction.

A subprocess, because the interpreter tests switch this process's Triton to interpreting mode. This
is a compile check only (no bits, no timings): it keeps a kernel that cannot compile for the GPU
from reaching a device call.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from pallas_kernels import triton_attention_plan as tap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


def _script(args, cache_dir, code=None, timeout=600):
    """scripts/triton_aot_check.py with `args` -- or, given `code`, `python -c code SCRIPTS *args`
    -- outside the interpreter, with the Triton cache `cache_dir`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    scripts = os.path.join(ROOT, "scripts")
    cmd = ([sys.executable, "-c", code, scripts, *args] if code else
           [sys.executable, os.path.join(scripts, "triton_aot_check.py"), *args])
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One Triton cache for the file's tests: the launches the first test compiles are the ones
    the others compile again (with and without a change), and Triton's cache is keyed on the
    source, constants and options, so a hit is the same compile."""
    return tmp_path_factory.mktemp("triton-cache")


def _per_attention_launch(body: str) -> str:
    """`code` for _script: `body` (lines indented four spaces) run for each (label, fn, args,
    consts, opts) of triton_launches.attention_kernels(), triton_aot_check imported as `c`."""
    return ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "import triton_aot_check as c, triton_launches as L\n"
            "for label, fn, args, consts, opts in L.attention_kernels():\n" + body)


def test_every_tuned_gemm_and_attention_launch_compiles_for_sm90(cache):
    proc = _script([], cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any("4096+1024+1024" in line and "split" in line for line in lines), lines
    assert any(line.startswith("ok    attention hq=32 hkv=8 D=128 bf16 split") for line in lines)
    assert any(line.startswith("ok    attention hq=32 hkv=8 D=128 bf16 serial wide TPP=16")
               for line in lines)  # --numerics auto's prefill tile
    assert any(line.startswith("ok    attention hq=32 hkv=8 D=128 bf16 kv64 split")
               for line in lines)  # JENGINE_ATTENTION_KV_TILE=64's launches
    assert any(line.startswith("ok    rope_write hq=32 hkv=8 D=128 bf16") for line in lines)
    assert any(line.startswith("ok    rope_attention hq=32 hkv=8 D=128 bf16 fused qkv")
               for line in lines)  # RoPE + the KV write in the split launch (an experiment)
    assert any(line.startswith("ok    mla h=128 R=512 P=64 bf16 split") for line in lines)
    assert any(line.startswith("ok    add_rmsnorm rows H=4096 bf16 ROWS=") for line in lines)
    assert any(line.startswith("ok    silu N=58720256 bf16") for line in lines)
    # the routed experts' grouped GEMM at Qwen3-30B-A3B's widths (gate/up, down_proj)
    assert any(line.startswith("ok    moe expert N=768 K=2048 rows=64") for line in lines)
    assert any(line.startswith("ok    moe expert N=2048 K=768 rows=64") for line in lines)
    assert all(line.startswith("ok ") for line in lines), lines


def test_page_ids_per_split_change_no_float_instruction(cache):
    """The page ids per split move only where the K/V addresses come from (and the
    pipelining): every attention launch's sm_90 PTX has the same float instructions in the same
    order with it as without it -- the compiled form of "the same bits"."""
    proc = _script(["--same-float-ops"], cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 12 and all(line.startswith("same ") for line in lines), lines


def test_the_planned_register_bound_reaches_the_ptx(cache):
    """The leaf's planned page ids bound the narrow serial launch's registers (PAGES_MAXNREG):
    that launch's sm_90 PTX carries the .maxnreg directive, the page-ids-per-tile launch and the
    split schedule's do not (the control)."""
    code = _per_attention_launch(
        "    if label.startswith('attention hq=32 hkv=8 D=128 bf16 s') and 'dot' not in label:\n"
        "        ptx = c._compile(fn, args, consts, *opts).asm['ptx']\n"
        "        print(label, '|', [l.strip() for l in ptx.splitlines() if '.maxnreg' in l])\n")
    proc = _script([], cache, code=code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bounds = dict(line.split(" | ") for line in proc.stdout.splitlines())
    assert bounds["attention hq=32 hkv=8 D=128 bf16 serial pages"] == "['.maxnreg 128']", bounds
    assert bounds["attention hq=32 hkv=8 D=128 bf16 serial"] == "[]", bounds
    assert bounds["attention hq=32 hkv=8 D=128 bf16 split pages"] == "[]", bounds


def test_the_planned_merge_stages_pipeline_the_split_merge(cache):
    """MERGE_STAGES reaches the split launch: on the planned stages Triton's pipeliner turns the
    merge loop's loads of the stored splits into async copies (sm_90 TTGIR), which the same
    launch at MERGE_STAGES 0 (the control: the plain loop) does not have."""
    code = _per_attention_launch(
        "    if label == 'attention hq=32 hkv=8 D=128 bf16 kv64 split':\n"
        "        for stages in (consts['MERGE_STAGES'], 0):\n"
        "            ir = c._compile(fn, args, dict(consts, MERGE_STAGES=stages), *opts)\n"
        "            print(stages, ir.asm['ttgir'].count('ttg.async_copy_global_to_local'))\n")
    proc = _script([], cache, code=code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (planned, copies), (_, before) = (map(int, line.split()) for line in proc.stdout.splitlines())
    assert planned == tap.MERGE_STAGES > 1
    # the K/V tile's two copies either way; the merge's m, l and acc on top where pipelined
    assert copies >= before + 3, (copies, before)


def test_negative_control_another_row_sum_changes_the_float_instructions(cache):
    """The comparison above can fail: the same serial launch on the dot row sum (other bits)
    has other float instructions."""
    code = ("import sys; sys.path[:0] = [sys.argv[1]]\n"
            "import triton_aot_check as c, triton_launches as L\n"
            "label, fn, args, consts, opts = next(iter(L.attention_kernels()))\n"
            "ops = [c.float_ops(c._compile(fn, args, dict(consts, ROWSUM=r), *opts).asm['ptx'])\n"
            "       for r in (0, 2)]\n"
            "print(label, len(ops[0]), len(ops[1]), ops[0] == ops[1])\n")
    proc = _script([], cache, code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("attention hq=32 hkv=8 D=128 bf16 serial "), proc.stdout
    assert proc.stdout.split()[-1] == "False", proc.stdout


def test_the_fused_rope_attention_launch_rotates_with_rope_writes_operations(cache):
    """RoPE inside the split launch (triton_rope_attention.py): on the lines of the shared `rope`
    helper, every fused launch's sm_90 PTX has rope_write_kernel's float operations per element
    (mul.rn x2, neg, add.rn; no fma: fp fusion off in both) -- the compiled form of "the same
    rotation". The script also reports registers and spills against the split launch."""
    proc = _script(["--rope-attention"], cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "rope_attention" in line]
    assert len(lines) == 8 and all(line.startswith("same ") for line in lines), lines


def test_negative_control_fp_fusion_contracts_the_rotation(cache):
    """The check above can fail: the fused launch compiled with fp fusion on has an fma on the
    rotation's lines."""
    code = ("import sys, inspect; sys.path[:0] = [sys.argv[1]]\n"
            "import triton_aot_check as c, triton_launches as L\n"
            "from pallas_kernels import _triton_rope_write_kernels as RW\n"
            "body, first = inspect.getsourcelines(RW.rope.fn)\n"
            "path, lines = inspect.getsourcefile(RW.rope.fn), range(first, first + len(body))\n"
            "for label, fn, args, consts, opts in L.rope_attention_kernels():\n"
            "    if label == 'rope_attention hq=32 hkv=8 D=128 bf16 fused':\n"
            "        ptx = c._compile(fn, args, consts, opts[0], opts[1], True).asm['ptx']\n"
            "        print(sorted(set(c.float_ops_of_lines(ptx, path, lines))))\n")
    proc = _script([], cache, code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fma" in proc.stdout, proc.stdout


BROKEN = '''
import triton
import triton.language as tl


@triton.jit
def broken(a_ptr, b_ptr):
    # Selecting between pointers of different element types: what the grouped GEMM would do if
    # its unused third output were f32 next to bf16 members.
    p = tl.where(tl.program_id(0) > 0, a_ptr, b_ptr)
    tl.store(p, 1.0)
'''


def test_negative_control_a_kernel_triton_refuses_fails_the_check(tmp_path):
    (tmp_path / "broken_kernel.py").write_text(BROKEN)
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
            "import broken_kernel, triton_aot_check as c\n"
            "c._compile(broken_kernel.broken, {'a_ptr': '*fp32', 'b_ptr': '*bf16'}, {}, 4, 1)\n")
    proc = _script([str(tmp_path)], tmp_path / "cache", code, timeout=300)
    assert proc.returncode != 0
    assert "CompilationError" in proc.stderr, proc.stderr[-2000:]
