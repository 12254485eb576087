"""What makes the device idle between two Triton launches? (#19)

    python scripts/gpu_launch_gaps.py [--out DIR] [--launches 256] [--iters 30]

rl-bitwise's bs 1 decode step idles ~2.1 µs after each of its ~260 Triton launches against ~0.8
µs after XLA's own kernels (H100 profile, docs/performance.md), and the gap barely shrinks inside a
CUDA graph, so it is not the host's launch path. This script times one kernel (y = x + 1) chained
`--launches` times in one jitted function, every launch a typed-FFI call (one CUDA graph: no host
in the way), at 1 and 132 programs of 1024 elements, in five forms:

  2 args    the kernel alone
  20 args   with 18 more arguments it never reads (6 pointers, 12 integers: the engine's GEMM
            launches pass ~20)
  counted   counting its programs with the engine's `last_to_arrive` (the acquire / release
            atomic the split-K GEMM's fused reduce and the split attention's merge use), one
            counter buffer threaded through the chain as the model step threads it
  release   the same count as a release atomic, the last program acquiring with a second
            atomic, a compare-and-swap that also resets the counter (what the merge needs, split
            in two: is the acquire half of the cost?)
  relaxed   the count as a relaxed atomic: orders nothing, so no merge could use it; the floor
            under the other two (one atomic's round trip to L2)
  xla       the same add as XLA's own kernels (each also summing its input, which keeps XLA
            from fusing two adds into one), in XLA's command buffer; the time is divided by the
            fusions XLA made. Is a Triton launch's gap longer than an XLA kernel's? (Run again
            with XLA_FLAGS=--xla_gpu_enable_pdl=false to see what XLA's early launch gives it.)

Time: the median over --iters calls, blocked on, per launch. Each chain's result is checked
(every launch adds 1). Writes launch_gaps.json / .md to --out.

(The thirty-ninth session also timed launches asking for more shared memory than they use, to see
whether a change of the L1 / shared split between launches costs: it did not, here or in the
model's step; docs/performance.md has the figures. That switch was removed.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pallas_kernels._triton_kernels import last_to_arrive  # noqa: E402

PROGRAMS = (1, 132)
BLOCK = 1024


@triton.jit
def touch(x_ptr, y_ptr, BLOCK: tl.constexpr):  # the kernel, and every other form's body
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1.0)


@triton.jit
def touch_args(x_ptr, p0, p1, p2, p3, p4, p5, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11,
               y_ptr, BLOCK: tl.constexpr):
    touch(x_ptr, y_ptr, BLOCK)


@triton.jit
def touch_counted(x_ptr, counters_in, y_ptr, counters, BLOCK: tl.constexpr):
    touch(x_ptr, y_ptr, BLOCK)
    last_to_arrive(counters, tl.num_programs(0))


@triton.jit
def touch_release(x_ptr, counters_in, y_ptr, counters, BLOCK: tl.constexpr):
    touch(x_ptr, y_ptr, BLOCK)
    tl.debug_barrier()
    if tl.atomic_add(counters, 1, sem="release", scope="gpu") == tl.num_programs(0) - 1:
        # The acquire and the reset in one atomic (an acquiring add of 0 whose result goes
        # unused is dropped by the compiler).
        tl.atomic_cas(counters, tl.num_programs(0), 0, sem="acquire", scope="gpu")


@triton.jit
def touch_relaxed(x_ptr, counters_in, y_ptr, counters, BLOCK: tl.constexpr):
    touch(x_ptr, y_ptr, BLOCK)
    tl.debug_barrier()
    if tl.atomic_add(counters, 1, sem="relaxed", scope="gpu") == tl.num_programs(0) - 1:
        tl.atomic_xchg(counters, 0, sem="relaxed", scope="gpu")


# name -> (kernel, the extra inputs chain() passes it); "xla": the same add as XLA's own kernel
FORMS = {"2 args": (touch, "plain"), "20 args": (touch_args, "args"),
         "counted": (touch_counted, "counted"), "release": (touch_release, "counted"),
         "relaxed": (touch_relaxed, "counted"), "xla": (None, "xla")}


def chain(kernel, form, launches, programs):
    import jax
    import jax.numpy as jnp

    from pallas_kernels._triton_launch import Counters, counter_chain, jax_launch

    def run(x):
        if form == "xla":  # each add its own kernel: a fusion cannot broadcast a reduction it
            for _ in range(launches):  # makes, so x's sum starts the next one (0 * sum adds 0)
                x = x + 0.0 * jnp.sum(x) + 1.0
            return x
        spare = [jnp.zeros((16,), jnp.float32) for _ in range(6)]
        extra = {"plain": [], "args": spare + [3, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37],
                 "counted": [Counters(1)]}[form]
        with counter_chain():
            for _ in range(launches):
                x = jax_launch(kernel, [x] + extra, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               (programs,), num_warps=4, num_stages=1, BLOCK=BLOCK)
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
    os.environ["JENGINE_TRITON_CALL"] = "ffi"  # every launch in the graph
    import jax
    import jax.numpy as jnp

    rows = []
    for programs in PROGRAMS:
        x = jnp.zeros((programs * BLOCK,), jnp.float32)
        for name, (kernel, form) in FORMS.items():
            fn = chain(kernel, form, args.launches, programs)
            # XLA's form: its kernels are its fusions (one line each, `kind=` on it)
            kernels = args.launches if kernel else sum(
                1 for line in fn.lower(x).compile().as_text().splitlines()
                if " fusion(" in line and "kind=" in line)
            us = time_us(fn, x, args.iters) / kernels
            got = float(jax.device_get(fn(x))[0])
            rows.append(dict(programs=programs, form=name, kernels=kernels,
                             us_per_launch=round(us, 3), result_ok=got == args.launches))
            print(f"programs {programs:3d} x {BLOCK}  {name:8s} {us:7.3f} us a launch  "
                  f"({kernels} kernels; result {got:g}, expected {args.launches})", flush=True)
    device = str(jax.devices()[0].device_kind)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_gaps.json"), "w") as f:
        json.dump(dict(device=device, launches=args.launches, iters=args.iters, rows=rows), f,
                  indent=1)
    with open(os.path.join(args.out, "launch_gaps.md"), "w") as f:
        f.write(f"# Launch gaps ({device}, {args.launches} typed-FFI launches a call, µs a "
                f"launch, median of {args.iters})\n\n")
        f.write(f"| programs x {BLOCK} | " + " | ".join(FORMS) + " |\n")
        f.write("|---|" + "---|" * len(FORMS) + "\n")
        for programs in PROGRAMS:
            cells = [f"{r['us_per_launch']:.3f}" for r in rows if r["programs"] == programs]
            f.write(f"| {programs} | " + " | ".join(cells) + " |\n")
    return 0 if all(r["result_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
