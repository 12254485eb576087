"""Can a decode step run the Triton GEMM with another tile and keep every bit? (issue #19)

    python scripts/gpu_gemm_decode_tiles.py [--out DIR] [--budget-s 420] [--smoke]

A row's bits come from the K schedule: BK-deep tl.dot steps in order from a zero accumulator
inside each of KSPLIT chunks, the chunk sums added in order (pallas_kernels/_triton_gemm_kernels.py).
BM, BN, num_warps and num_stages only decide how many rows and columns one program holds and how
far its loads run ahead, so a tile that keeps (BK, KSPLIT) *may* give the same bits -- unless the
MMA instruction Triton picks (wgmma for BM >= 64 with 4k warps, mma.sync below) rounds inside its
K16 step differently. This measures it, on the Llama-3-8B projections in rl-bitwise's path (the
JAX launch through jax-triton):

  bits    every candidate's output vs the contract tile's (triton_gemm_tiles.json), float bits
          of f32 outputs (the accumulator before the bf16 rounding, so no difference hides under
          it), at M = 1, 3, 16, 64, 200, for each projection and the q/k/v and gate/up grouped
          launches; inputs random with rows scaled 1e-3 .. 1e3 and exact zeros / -0.0 in x. The control: the
          contract tile with twice the K chunks must differ (the check can fail). BK/2 is a
          candidate too: wgmma steps K 16 at a time, so BK itself may not reach the bits.
  timing  device µs per GEMM at M = 1, 16, 64: a chain over >= 1.5 GiB of distinct weights
          inside one jit (L2 cannot hold them), median of 10 samples of 3 chains back to back.

`--candidates` also takes prefill launch shapes (`--time-rows 1024 4096 --bits-rows 1 200 1024`): a
fifth field picks the schedule (serial, split, or fused: the split schedule with its reduce inside
the launch), and `--xla` times XLA's own dot (auto's GEMM) at the same rows for reference.

Writes gemm_decode_tiles.json / .md to --out. `--smoke` runs the bits part on the CPU under the
Triton interpreter with tiny shapes (how this script is checked off the GPU); timings need a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BITS_ROWS = (1, 3, 16, 64, 200)
TIME_ROWS = (1, 16, 64)
# (BM, BN, num_warps, num_stages): BK and KSPLIT always the contract tile's.
CANDIDATES = [(64, 64, 4, 4), (64, 64, 4, 6), (64, 128, 4, 4), (64, 128, 4, 6), (64, 32, 4, 8),
              (128, 64, 8, 4), (64, 256, 8, 3), (16, 64, 4, 4), (16, 128, 4, 4), (32, 64, 4, 4)]
SHAPES = {"q/o_proj": [4096], "k/v_proj": [1024], "gate/up_proj": [14336], "down_proj": [4096],
          "qkv group": [4096, 1024, 1024], "gate_up group": [14336, 14336]}
K_OF = {"down_proj": 14336}
SMOKE_SHAPES = {"q": [64], "qkv group": [64, 32, 32]}
SMOKE_CANDIDATES = [(16, 32, 4, 2), (32, 16, 4, 2)]


def inputs(m, k, ns, seed, dtype):
    import jax
    import jax.numpy as jnp

    kx, *kw = jax.random.split(jax.random.key(seed), 1 + len(ns))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    scale = jnp.asarray([10.0 ** ((i % 7) - 3) for i in range(m)], jnp.float32)[:, None]
    x = x * scale
    x = x.at[:, ::17].set(0.0).at[:, 5::19].set(-0.0)
    ws = [(jax.random.normal(kk, (k, n), jnp.float32) * k ** -0.5).astype(dtype)
          for kk, n in zip(kw, ns)]
    return x.astype(dtype), ws


TORCH = False  # --smoke: the torch launches on CPU tensors (the interpreter has no jax-triton)


def run(tile, x, ws, out_dtype=None, schedule=None):
    import jax.numpy as jnp

    from pallas_kernels import triton_gemm as tg

    if tile == "xla":  # auto's GEMM, for reference timings
        return tuple(jnp.dot(x, w) for w in ws)

    if TORCH:
        import numpy as np
        import torch

        def to_torch(a):
            return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16)

        x, ws = to_torch(x), [to_torch(w) for w in ws]
        one, group = tg.gemm_triton_torch, tg.gemm_group_triton_torch
    else:
        one, group = tg.gemm_triton, tg.gemm_group_triton
    out_dtype = out_dtype or jnp.bfloat16
    if len(ws) == 1:
        return (one(x, ws[0], out_dtype=out_dtype, tile=tile, schedule=schedule),)
    return group(x, ws, out_dtype=out_dtype, tile=tile, schedule=schedule)


def differing(a, b) -> int:
    import numpy as np

    from pallas_kernels._triton_launch import bits

    return int(sum(np.count_nonzero(bits(p) != bits(q)) for p, q in zip(a, b)))


def chain_weights(k, ns, dtype):
    """>= 1.5 GiB of distinct weights (L2 holds 50 MB): [[w per member] per layer]."""
    import jax

    layers = max(2, min(32, int(1.5 * 2**30) // (k * sum(ns) * 2)))
    keys = jax.random.split(jax.random.key(sum(ns) + k), layers * len(ns))
    return [[jax.random.normal(keys[i * len(ns) + j], (k, n), dtype) * 0.01
             for j, n in enumerate(ns)] for i in range(layers)]


def device_us(tile, schedule, weights, m, dtype, iters) -> float:
    import jax

    from jengine.bench.common import _median_time

    x, _ = inputs(m, weights[0][0].shape[0], [1], 7, dtype)
    chain = jax.jit(lambda x, weights: tuple(run(tile, x, ws, schedule=schedule)
                                             for ws in weights))
    t = _median_time(lambda: chain(x, weights), iters, back_to_back=3, sync=jax.block_until_ready)
    return t / len(weights) * 1e6


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gemm_decode_tiles"))
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument("--shapes", nargs="*", help=f"a subset of {sorted(SHAPES)}")
    p.add_argument("--candidates", nargs="*",
                   help="launch shapes as BM,BN,WARPS,STAGES[,serial|split] (default: a set)")
    p.add_argument("--skip-bits", action="store_true", help="timings only (exploring)")
    p.add_argument("--time-rows", type=int, nargs="*", default=list(TIME_ROWS))
    p.add_argument("--bits-rows", type=int, nargs="*", default=list(BITS_ROWS))
    p.add_argument("--xla", action="store_true", help="also time XLA's dot (auto's GEMM)")
    args = p.parse_args()
    if args.smoke:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import triton_interpreter  # noqa: F401  (before the kernels' module is imported)

        global TORCH
        TORCH = True
    import dataclasses

    import jax.numpy as jnp

    from pallas_kernels.triton_gemm_tiles import tile_for

    t_start = time.monotonic()
    dtype = jnp.bfloat16
    shapes = SMOKE_SHAPES if args.smoke else {k: v for k, v in SHAPES.items()
                                               if not args.shapes or k in args.shapes}
    candidates = SMOKE_CANDIDATES if args.smoke else CANDIDATES
    if args.candidates:
        candidates = [tuple(int(v) if v.isdigit() else v for v in c.split(","))
                      for c in args.candidates]
    rows_bits = (1, 3, 17) if args.smoke else tuple(args.bits_rows)
    os.makedirs(args.out, exist_ok=True)
    result = {"bits": [], "timing": [], "skipped": []}

    def save():
        with open(os.path.join(args.out, "gemm_decode_tiles.json"), "w") as f:
            json.dump(result, f, indent=1)

    for name, ns in shapes.items():
        k = 32 * 8 if args.smoke else K_OF.get(name, 4096)
        contract = tile_for(ns[0], k, dtype)
        if args.smoke:  # the tiny shapes take the default tile; give them a split one
            contract = dataclasses.replace(contract, block_m=16, block_n=16, block_k=32,
                                           num_warps=4, num_stages=2, k_split=2,
                                           split_at_every_m=True)
        tiles = {"contract " + contract.describe(): (contract, None),
                 "control KSPLIT*2": (dataclasses.replace(contract, k_split=contract.k_split * 2),
                                      None),
                 "BK/2": (dataclasses.replace(contract, block_k=contract.block_k // 2), None)}
        if not args.smoke:
            table = tile_for(ns[0], k, dtype, 1)
            if table != contract:
                tiles["table at M <= 64 " + table.describe()] = (table, None)
        for bm, bn, w, s, *schedule in candidates:
            tile = dataclasses.replace(contract, block_m=bm, block_n=bn, num_warps=w,
                                       num_stages=s)
            if schedule == ["fused"]:  # the split schedule with its reduce in the launch
                tile, schedule = dataclasses.replace(tile, fused_reduce=True), ["split"]
            tiles[tile.describe() + "".join(f" {v}" for v in schedule)] = (tile, *schedule[:1])
        if args.xla:
            tiles["xla dot (auto)"] = ("xla", None)
        for m in () if args.skip_bits else rows_bits:
            x, ws = inputs(m, k, ns, m, dtype)
            ref = run(contract, x, ws, jnp.float32)
            for label, (tile, *schedule) in tiles.items():
                if label.startswith("contract") or tile == "xla":
                    continue
                try:
                    n, err = differing(ref, run(tile, x, ws, jnp.float32, *schedule)), None
                except Exception as exc:  # noqa: BLE001 -- a tile that fails to compile is a result
                    n, err = None, f"{type(exc).__name__}: {str(exc)[:160]}"
                result["bits"].append(dict(shape=name, m=m, tile=label, differ=n, error=err))
                print(f"bits {name} M={m} {label}: {n if err is None else err}", flush=True)
        save()
        if args.smoke:
            continue
        weights = chain_weights(k, ns, dtype)
        for label, (tile, *schedule) in tiles.items():
            if label.startswith("control"):
                continue
            for m in args.time_rows:
                if time.monotonic() - t_start > args.budget_s:
                    result["skipped"].append(dict(shape=name, m=m, tile=label))
                    continue
                try:
                    us, err = device_us(tile, (schedule or [None])[0], weights, m, dtype,
                                        args.iters), None
                except Exception as exc:  # noqa: BLE001
                    us, err = None, f"{type(exc).__name__}: {str(exc)[:160]}"
                weight_bytes = k * sum(ns) * 2
                result["timing"].append(dict(shape=name, m=m, tile=label, us=us, TBps=None
                                             if us is None else weight_bytes / us / 1e6,
                                             error=err))
                print(f"time {name} M={m} {label}: "
                      f"{'-' if us is None else f'{us:.1f} us'} {err or ''}", flush=True)
            save()
        del weights
    save()
    write_md(result, args.out, args.time_rows)
    if args.skip_bits:
        return 0
    bad_control = [r for r in result["bits"] if r["tile"].startswith("control") and not r["differ"]]
    if bad_control:
        print(f"CONTROL FAILED: KSPLIT*2 gave equal bits in {len(bad_control)} cases", flush=True)
        return 1
    return 0


def write_md(result, out, time_rows=TIME_ROWS):
    lines = ["| shape | tile | f32 outputs differing at M = " + ", ".join(map(str, BITS_ROWS))
             + " | µs at M = " + ", ".join(map(str, time_rows)) + " |", "|---|---|---|---|"]
    keys = []
    for r in result["bits"] + result["timing"]:
        if (r["shape"], r["tile"]) not in keys:
            keys.append((r["shape"], r["tile"]))
    for shape, tile in keys:
        bits = {r["m"]: r["differ"] if r["error"] is None else "err"
                for r in result["bits"] if (r["shape"], r["tile"]) == (shape, tile)}
        us = {r["m"]: "-" if r["us"] is None else f"{r['us']:.1f}"
              for r in result["timing"] if (r["shape"], r["tile"]) == (shape, tile)}
        lines.append(f"| {shape} | {tile} | {' / '.join(str(v) for v in bits.values()) or '-'} | "
                     f"{' / '.join(us.values()) or '-'} |")
    with open(os.path.join(out, "gemm_decode_tiles.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
