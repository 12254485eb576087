"""What makes the device idle between two Triton launches? (#19)

    python scripts/gpu_launch_gaps.py [--out DIR] [--launches 256] [--iters 30]

rl-bitwise's bs 1 decode step idles ~2.1 µs after each of its ~260 Triton launches against ~0.8
µs after XLA's own kernels (H100 profile, docs/performance.md), and the gap barely shrinks inside a
CUDA graph, so it is not the host's launch path. One device-side suspect: an SM's L1 / shared
memory split (the carveout) follows each launch's shared memory, and the step alternates launches
with none (the boundary, SiLU) and GEMMs on 64-96 KB; a split that changes between two kernels may
cost a drain. This script times one kernel (y = x + 1, the same PTX every launch) chained
`--launches` times in one jitted function, each launch asking for the shared memory a pattern
gives it (`jax_launch(shared_floor=...)`: the kernel uses none of it). If the carveout costs
nothing, every pattern takes the same time per launch; if it costs, the alternating patterns are
slower than either of their parts alone.

The second table times three forms of the same kernel, one CUDA graph of typed-FFI calls each: as
above (2 arguments), with 18 more it never reads (6 pointers, 12 integers: the GEMM launches pass
~20), and counting its programs with the engine's `last_to_arrive` (the split-K reduce's and the
split attention's acquire / release atomic, one counter buffer threaded through the chain as the
model step threads it).

The launches are typed-FFI calls (one CUDA graph: no host in the way), at 1 and 132 programs of
1024 elements. Time: the median over --iters calls, blocked on, per launch. --parts picks the
tables (smem, forms). Writes launch_gaps.json / .md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

K = 1024
# name -> the shared memory (bytes) of consecutive launches, cycled. "layer" is rl-bitwise's decode
# layer at bs 1 in launch order (the boundary, q/k/v, RoPE + attention, o, the boundary, gate/up,
# SiLU, down; scripts/triton_aot_check.py's sizes), then the same with floors under it.
PATTERNS = {
    "0": [0], "64K": [64 * K], "96K": [96 * K],
    "0/64K": [0, 64 * K], "0/96K": [0, 96 * K], "64K/96K": [64 * K, 96 * K],
    "38K/64K": [38 * K, 64 * K], "0/8K": [0, 8 * K],
    "layer": [0, 64 * K, 38 * K, 64 * K, 0, 96 * K, 0, 64 * K],
    "layer, floor 64K": [64 * K, 64 * K, 64 * K, 64 * K, 64 * K, 96 * K, 64 * K, 64 * K],
    "layer, floor 96K": [96 * K] * 8,
}
SETTINGS = [("ffi", 1, 1024), ("ffi", 132, 1024)]


def touch_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def touch(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1.0)

    return touch


def form_kernels():
    import triton
    import triton.language as tl

    from pallas_kernels._triton_kernels import last_to_arrive

    @triton.jit
    def touch_args(x_ptr, p0, p1, p2, p3, p4, p5, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10,
                   s11, y_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1.0)

    @triton.jit
    def touch_counted(x_ptr, counters_in, y_ptr, counters, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1.0)
        last_to_arrive(counters, tl.num_programs(0))

    return touch_args, touch_counted


def chain(kernel, pattern, launches, programs, block, form="plain"):
    import jax
    import jax.numpy as jnp

    from pallas_kernels._triton_launch import Counters, counter_chain, jax_launch

    def run(x):
        spare = [jnp.zeros((16,), jnp.float32) for _ in range(6)]
        with counter_chain():
            for i in range(launches):
                extra = {"plain": [], "args": spare + [3, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37],
                         "counted": [Counters(1)]}[form]
                x = jax_launch(kernel, [x] + extra, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               (programs,), num_warps=4, num_stages=1,
                               shared_floor=pattern[i % len(pattern)], BLOCK=block)
        return x

    return jax.jit(run)


def time_us(fn, x, iters):
    fn(x).block_until_ready()
    fn(x).block_until_ready()
    walls = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls) * 1e6


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--launches", type=int, default=256)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--parts", nargs="+", choices=("smem", "forms"), default=["smem", "forms"])
    args = p.parse_args()
    import jax
    import jax.numpy as jnp

    kernel = touch_kernel()
    rows = []
    for call, programs, block in SETTINGS if "smem" in args.parts else []:
        os.environ["JENGINE_TRITON_CALL"] = call  # read as each chain is traced
        x = jnp.zeros((programs * block,), jnp.float32)
        for name, pattern in PATTERNS.items():
            fn = chain(kernel, pattern, args.launches, programs, block)
            us = time_us(fn, x, args.iters) / args.launches
            got = float(jax.device_get(fn(x))[0])
            rows.append(dict(call=call, programs=programs, block=block, pattern=name,
                             us_per_launch=round(us, 3), result_ok=got == args.launches))
            print(f"{call:6s} programs {programs:3d} x {block:5d}  {name:18s} "
                  f"{us:7.3f} us a launch  (result {got:g}, expected {args.launches})",
                  flush=True)
    os.environ["JENGINE_TRITON_CALL"] = "ffi"
    touch_args, touch_counted = form_kernels()
    forms = {"2 args": (kernel, "plain"), "20 args": (touch_args, "args"),
             "counted": (touch_counted, "counted")}
    form_rows = []
    for programs in (1, 132) if "forms" in args.parts else ():
        x = jnp.zeros((programs * 1024,), jnp.float32)
        for name, (fn_kernel, form) in forms.items():
            fn = chain(fn_kernel, [0], args.launches, programs, 1024, form)
            us = time_us(fn, x, args.iters) / args.launches
            got = float(jax.device_get(fn(x))[0])
            form_rows.append(dict(programs=programs, form=name, us_per_launch=round(us, 3),
                                  result_ok=got == args.launches))
            print(f"ffi    programs {programs:3d} x  1024  {name:18s} {us:7.3f} us a launch  "
                  f"(result {got:g}, expected {args.launches})", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_gaps.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0].device_kind), launches=args.launches,
                       iters=args.iters, rows=rows, forms=form_rows), f, indent=1)
    with open(os.path.join(args.out, "launch_gaps.md"), "w") as f:
        f.write(f"# Launch gaps ({jax.devices()[0].device_kind}, "
                f"{args.launches} launches a call, median of {args.iters})\n\n")
        if rows:
            f.write("| call | programs x elements | " + " | ".join(PATTERNS) + " |\n")
            f.write("|---|---|" + "---|" * len(PATTERNS) + "\n")
            for call, programs, block in SETTINGS:
                cells = [f"{r['us_per_launch']:.3f}" for r in rows
                         if (r["call"], r["programs"]) == (call, programs)]
                f.write(f"| {call} | {programs} x {block} | " + " | ".join(cells) + " |\n")
        if form_rows:
            f.write("\n| programs x 1024, typed-FFI call | " + " | ".join(forms) + " |\n")
            f.write("|---|" + "---|" * len(forms) + "\n")
            for programs in (1, 132):
                cells = [f"{r['us_per_launch']:.3f}" for r in form_rows
                         if r["programs"] == programs]
                f.write(f"| {programs} | " + " | ".join(cells) + " |\n")
    return 0 if all(r["result_ok"] for r in rows + form_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
