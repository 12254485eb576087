"""Does a change of shared memory between two Triton launches cost the device time? (#19)

    python scripts/gpu_smem_gaps.py [--out DIR] [--launches 256] [--iters 30]

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

Three settings: the launches on the typed-FFI call (one CUDA graph: no host in the way) at 1 and
132 programs of 1024 elements, and on jax-triton's legacy call at 132 programs of 64 Ki elements
(long enough that the host keeps ahead). Time: the median over --iters calls, blocked on, per
launch. Writes smem_gaps.json / .md to --out.
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
SETTINGS = [("ffi", 1, 1024), ("ffi", 132, 1024), ("legacy", 132, 65536)]


def touch_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def touch(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1.0)

    return touch


def chain(kernel, pattern, launches, programs, block):
    import jax

    from pallas_kernels._triton_launch import jax_launch

    def run(x):
        for i in range(launches):
            x = jax_launch(kernel, [x], jax.ShapeDtypeStruct(x.shape, x.dtype), (programs,),
                           num_warps=4, num_stages=1, shared_floor=pattern[i % len(pattern)],
                           BLOCK=block)
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
    args = p.parse_args()
    import jax
    import jax.numpy as jnp

    kernel = touch_kernel()
    rows = []
    for call, programs, block in SETTINGS:
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
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "smem_gaps.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0].device_kind), launches=args.launches,
                       iters=args.iters, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "smem_gaps.md"), "w") as f:
        f.write(f"# Shared memory between launches ({jax.devices()[0].device_kind}, "
                f"{args.launches} launches a call, median of {args.iters})\n\n")
        f.write("| call | programs x elements | " + " | ".join(PATTERNS) + " |\n")
        f.write("|---|---|" + "---|" * len(PATTERNS) + "\n")
        for call, programs, block in SETTINGS:
            cells = [f"{r['us_per_launch']:.3f}" for r in rows
                     if (r["call"], r["programs"]) == (call, programs)]
            f.write(f"| {call} | {programs} x {block} | " + " | ".join(cells) + " |\n")
    return 0 if all(r["result_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
