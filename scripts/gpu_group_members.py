"""From how many rows are the q/k/v and gate/up groups faster as launches of their own, and do they
keep their bits? (#19; docs/performance.md, thirtieth and thirty-first sessions: the H100 answer,
from 1024 rows, made the wide prefill tiles ungrouped)

    python scripts/gpu_group_members.py [--out DIR] [--rows 512 1024 2048 4096] [--groups q/k/v]

On the H100 at 4096 rows the q/k/v group's one launch on the wide prefill tile (128 x 256) took
422-435 µs and its members alone 221 + 58 + 58. For each M: the group's one launch
(gemm_group_triton on the tile the members share at that M) against one gemm_triton launch per
member on the same tile -- the trainer's own launches -- f32 outputs (the accumulator's bits,
before any rounding could hide a difference), and the device µs of each (a jitted chain over 8
weight copies, so the weights come from HBM; median of 5). Control: the one launch with twice the
K chunks must differ. Llama-3-8B's q/k/v (N 4096 + 1024 + 1024) and gate/up (2 x 14336), K 4096,
bf16. Writes group_members.json / .md to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GROUPS = {"q/k/v": (4096, 1024, 1024), "gate/up": (14336, 14336)}
K = 4096
COPIES = 8


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/group_members"))
    p.add_argument("--rows", type=int, nargs="*", default=[512, 1024, 2048, 4096])
    p.add_argument("--groups", nargs="*", default=list(GROUPS), choices=list(GROUPS))
    args = p.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import triton_gemm as tg
    from tests.bits import count_bit_differences as bits_differ

    def device_us(fn, x, copies) -> float:
        chain = jax.jit(lambda x, copies: [fn(x, ws) for ws in copies])
        jax.block_until_ready(chain(x, copies))
        samples = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(chain(x, copies))
            samples.append((time.perf_counter() - t) / len(copies) * 1e6)
        return float(np.median(samples))

    os.makedirs(args.out, exist_ok=True)
    rows = []
    lines = ["| group | M | shared tile | bits differing (members alone vs one launch) | "
             "control | members alone µs | one launch µs |", "|---|---|---|---|---|---|---|"]
    key = jax.random.key(0)
    for name in args.groups:
        ns = GROUPS[name]

        def weight(c, i, n):
            w = jax.random.normal(jax.random.fold_in(key, 10 * c + i), (K, n)) * K ** -0.5
            return w.astype(jnp.bfloat16)

        copies = [tuple(weight(c, i, n) for i, n in enumerate(ns)) for c in range(COPIES)]
        for m in args.rows:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, K)).astype(jnp.bfloat16)
            tile = tg.tile_for(ns[0], K, jnp.bfloat16, m)
            # (group_tile would be None on a tile marked ungrouped: the forced tile still groups)
            assert {tg.tile_for(n, K, jnp.bfloat16, m) for n in ns} == {tile}, "no shared tile"

            def alone(x, ws, tile=tile):
                return tuple(tg.gemm_triton(x, w, out_dtype=jnp.float32, tile=tile) for w in ws)

            def one(x, ws, tile=tile):
                return tg.gemm_group_triton(x, ws, out_dtype=jnp.float32, tile=tile)

            twice = dataclasses.replace(tile, k_split=tile.k_split * 2)
            want = jax.jit(one)(x, copies[0])
            differ = sum(bits_differ(a, b) for a, b in zip(jax.jit(alone)(x, copies[0]), want))
            control = sum(bits_differ(a, b) for a, b in zip(
                jax.jit(lambda x, ws: one(x, ws, twice))(x, copies[0]), want))
            row = dict(group=name, m=m, tile=tile.describe(), differ=differ,
                       control_differ=control, alone_us=device_us(alone, x, copies),
                       one_launch_us=device_us(one, x, copies))
            print(row, flush=True)
            rows.append(row)
            lines.append(f"| {name} | {m} | {row['tile']} | {differ} | {control} (must be > 0) | "
                         f"{row['alone_us']:.1f} | {row['one_launch_us']:.1f} |")
    with open(os.path.join(args.out, "group_members.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "group_members.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    bad = [r for r in rows if r["differ"] or not r["control_differ"]]
    print("group_members:", "FAIL" if bad else "PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
