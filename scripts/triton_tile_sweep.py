"""Time candidate fixed tiles of the Triton GEMM on the Llama-3-8B projection shapes (GPU only).

    python scripts/triton_tile_sweep.py [--out DIR] [--budget-s 240]

For each (N, K) and each candidate tile, the kernel is timed (torch launch, triton.testing.do_bench,
median, L2 flushed between runs) at M in {1, 16, 64, 256, 4096}, next to torch.matmul (cuBLAS).
A tile is one choice per (N, K) for every M, so the score of a tile is the geometric mean over M
of its time divided by the best candidate's time at that M; the table prints both.

Caveat measured on the H200: do_bench times each call with events, and at M <= 256 a kernel of
20-60 us is shorter than the torch launcher's Python work, so small-M times here include launch
overhead and vary between machines (up to 2x). Use them for M = 4096 only; for small M compare tiles
with `jengine bench --parts leaves --tile-candidates ...`, which times chains inside one jit. The chosen
tiles go into a table of pallas_kernels/triton_gemm_tiles.json by hand, with the numbers in
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {  # name: (N, K) for x[M, K] @ w[K, N]
    "q_proj": (4096, 4096),
    "kv_proj": (1024, 4096),
    "gate/up": (14336, 4096),
    "down": (4096, 14336),
    "lm_head_pad": (131072, 4096),  # the bench's rl-bitwise rows (jengine/bench/common.py)
    "lm_head": (128256, 4096),
}
ROWS = (1, 16, 64, 256, 4096)


def candidates(spec=None):
    from pallas_kernels.triton_gemm import GemmTile as T

    if spec:  # "BM,BN,BK,GROUP_M,WARPS,STAGES" each
        return [T(*map(int, c.split(","))) for c in spec]

    return [T(64, 64, 64, 8, 4, 4), T(64, 128, 64, 8, 4, 4), T(64, 256, 64, 8, 4, 3),
            T(128, 128, 64, 8, 8, 4), T(128, 256, 64, 8, 8, 3), T(64, 32, 128, 8, 4, 4),
            T(64, 64, 128, 8, 4, 4), T(64, 128, 128, 8, 4, 3), T(128, 128, 128, 8, 8, 3)]


def main(argv=None) -> int:
    import torch
    import triton

    from pallas_kernels.triton_gemm import gemm_triton_torch

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--candidates", nargs="*", help="tiles as BM,BN,BK,GROUP_M,WARPS,STAGES")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES)[:5])
    args = p.parse_args(argv)
    start = time.time()
    torch.manual_seed(0)
    results = []
    for name in args.shapes:
        n, k = SHAPES[name]
        w = (torch.randn(k, n, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
        xs = {m: torch.randn(m, k, device="cuda").to(torch.bfloat16) for m in ROWS}
        row = {"shape": name, "N": n, "K": k, "cublas_ms": {}, "tiles": {}}
        for m in ROWS:
            row["cublas_ms"][m] = triton.testing.do_bench(lambda: xs[m] @ w, warmup=5, rep=20,
                                                          return_mode="median")
        for tile in candidates(args.candidates):
            if time.time() - start > args.budget_s * (len(results) + 1) / len(args.shapes):
                print(f"budget reached; stopping at {name} {tile.describe()}", flush=True)
                break
            times = {}
            try:
                for m in ROWS:
                    fn = lambda: gemm_triton_torch(xs[m], w, out_dtype=torch.bfloat16, tile=tile)
                    times[m] = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is reported
                times = {"error": repr(exc)[:200]}
            row["tiles"][tile.describe()] = times
        results.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tile_sweep.json"), "w") as f:
        json.dump(results, f, indent=1)
    # Summary: per shape, the tile with the best geometric-mean slowdown vs the per-M best.
    lines = ["| shape | tile | score | " + " | ".join(f"M={m} us" for m in ROWS) + " |",
             "|---|---|---|" + "---|" * len(ROWS)]
    for row in results:
        ok = {t: v for t, v in row["tiles"].items() if "error" not in v and len(v) == len(ROWS)}
        if not ok:
            continue
        best = {m: min(v[m] for v in ok.values()) for m in ROWS}
        score = {t: math.exp(sum(math.log(v[m] / best[m]) for m in ROWS) / len(ROWS))
                 for t, v in ok.items()}
        for t in sorted(ok, key=score.get)[:3]:
            lines.append(f"| {row['shape']} | {t} | {score[t]:.3f} | "
                         + " | ".join(f"{ok[t][m] * 1e3:.1f}" for m in ROWS) + " |")
        lines.append(f"| {row['shape']} | cuBLAS | - | "
                     + " | ".join(f"{row['cublas_ms'][m] * 1e3:.1f}" for m in ROWS) + " |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "tile_sweep.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
