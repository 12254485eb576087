"""The routed experts' GEMM (("moe", "grouped_gemm")) against the dense gemm leaf, and its speed.

    python scripts/gpu_grouped_gemm.py [--device cuda|cpu] [--small] [--out DIR]
    bash scripts/gpu_run.sh "$OUT" grouped_gemm          (the lead's H200 step)

At Qwen3-30B-A3B's widths (H 2048, I 768, 128 experts, top-8, bf16) for T = 1 .. 4096 tokens and
two routings (random; skewed: every token to experts 0..7, the largest groups):

  bits    (fatal) both projections' shapes (gate/up: N 768, K 2048; down: N 2048, K 768): every
          routed row of the grouped leaf (the JAX launch, in the plan's expert-sorted layout)
          == the dense gemm leaf on that row with its expert's weight (on the GPU: the Triton
          gemm launched from torch, the same kernel as the JAX leaf; row-invariant across M,
          scripts/gpu_validate.py); and the grouped leaf's torch launch == its JAX launch.
  control (fatal) the same comparison with the tile -> expert map shifted by one finds
          differences: the check can fail.
  timing  (reported) one MoE layer's experts, routed (routed_expert_outputs: three grouped
          launches) vs dense (every expert on every row, the path moe.py ran before, as a scan over
          the experts), medians of --iters after two warm-up calls, ms, for --timing-ts.

`--device cpu` runs the same code with the CPU's fixed-order leaves (`--small` shrinks the widths);
that is how this script is checked off the GPU. Prints a table, then one line of JSON (the
summary); exits 1 on a fatal mismatch. Writes grouped_gemm.json to --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jengine.models.layers.moe import expert_row_weights, slot_order_sum  # noqa: E402
from jengine.models.layers.moe_routed import routed_expert_outputs  # noqa: E402
from pallas_kernels._triton_launch import bits  # noqa: E402
from pallas_kernels._twin import to_torch  # noqa: E402
from pallas_kernels.moe_grouped_gemm import block_rows_for, plan_expert_tiles  # noqa: E402
from pallas_kernels.registry import plan  # noqa: E402

QWEN3_30B_A3B = dict(hidden=2048, inter=768, experts=128, top_k=8)
SMALL = dict(hidden=64, inter=48, experts=10, top_k=3)
TOKENS = (1, 2, 7, 64, 513, 4096)
SMALL_TOKENS = (1, 7, 33)


def kernels(hardware: str):
    """The rl-bitwise plans a MoE layer would hold on `hardware` (bf16)."""
    kw = dict(formats={"bf16"}, hardware=hardware, features={"batch_invariant"})
    return SimpleNamespace(**{name: plan(family, name, **kw) for family, name in (
        ("linear", "gemm"), ("linear", "gemm_group"), ("activation", "silu"),
        ("moe", "grouped_gemm"))}, expert_backend="batch_invariant")


def reference_gemm(kern, device: str):
    """torch (x [M, K], w [K, N]) -> [M, N] bf16: the dense gemm leaf's own torch launch."""
    import torch

    if device == "cuda":
        from pallas_kernels.triton_gemm import gemm_triton_torch

        return lambda x, w: gemm_triton_torch(x, w, out_dtype=torch.bfloat16)
    from pallas_kernels.gemm import gemm_fixed_order_torch

    assert kern.gemm.leaf.fn.__name__ == "gemm_fixed_order", kern.gemm.describe()
    return lambda x, w: gemm_fixed_order_torch(x, w, out_dtype=jnp.bfloat16)


def routing(kind: str, t: int, experts: int, k: int, rng) -> np.ndarray:
    if kind == "skewed":
        return np.tile(np.arange(k, dtype=np.int32), (t, 1))
    return np.argsort(rng.random((t, experts)), axis=1)[:, :k].astype(np.int32)


def check_projection(kern, ref, pairs_in, w, ids, block_rows, *, shift=0) -> dict:
    """Bits differing between the grouped leaf's rows and the dense leaf's, over every pair.
    pairs_in [P, K]: pair p's input row; shift: the tile -> expert map rolled (the control)."""
    import torch

    experts = w.shape[0]
    order, tile_expert, row_of_pair = plan_expert_tiles(jnp.asarray(ids), experts, block_rows)
    tile_expert = jnp.roll(tile_expert, shift)
    rows = pairs_in.at[order].get(mode="fill", fill_value=0)
    grouped = jax.jit(lambda r, w, te: kern.grouped_gemm(r, w, te, block_rows=block_rows,
                                                         out_dtype=jnp.bfloat16))
    out = grouped(rows, w, tile_expert)
    per_pair = bits(out[row_of_pair.reshape(-1)])
    flat = ids.reshape(-1)
    t_in, t_w = to_torch(pairs_in), to_torch(w)
    differing = 0
    for e in np.unique(flat):
        sel = np.nonzero(flat == e)[0]
        dense = ref(t_in[torch.from_numpy(sel).to(t_in.device)].contiguous(), t_w[int(e)])
        differing += int(np.count_nonzero(bits(dense) != per_pair[sel]))
    result = {"differing": differing, "rows": int(flat.size)}
    twin = getattr(sys.modules[kern.grouped_gemm.leaf.fn.__module__],
                   kern.grouped_gemm.leaf.fn.__name__ + "_torch")
    t_out = twin(to_torch(rows), t_w, to_torch(tile_expert), block_rows=block_rows,
                 out_dtype=torch.bfloat16 if "triton" in twin.__name__ else jnp.bfloat16)
    result["torch_vs_jax"] = int(np.count_nonzero(bits(t_out) != bits(out)))
    return result


def check_bits(kern, ref, dims, tokens, rng) -> tuple[list[dict], list[str]]:
    h, i, e, k = dims["hidden"], dims["inter"], dims["experts"], dims["top_k"]
    shapes = {"gate/up": (i, h), "down": (h, i)}  # (N, K)
    weights = {name: (jax.random.normal(jax.random.key(n), (e, kk, nn), jnp.float32)
                      / np.sqrt(kk)).astype(jnp.bfloat16)
               for n, (name, (nn, kk)) in enumerate(shapes.items())}
    block_rows = block_rows_for(shapes.values(), jnp.bfloat16)
    control_t = min(tokens, key=lambda t: abs(t - 64))
    table, failures = [], []
    for t in tokens:
        for kind in ("random", "skewed"):
            ids = routing(kind, t, e, k, rng)
            for name, (nn, kk) in shapes.items():
                if name == "gate/up":  # a token's row, once per slot
                    x = jax.random.normal(jax.random.key(t), (t, kk), jnp.float32)
                    pairs_in = jnp.repeat(x.astype(jnp.bfloat16), k, axis=0)
                else:  # the scaled activations: one row per pair
                    pairs_in = jax.random.normal(jax.random.key(t + 1), (t * k, kk),
                                                 jnp.float32).astype(jnp.bfloat16)
                row = dict(T=t, routing=kind, proj=name, block_rows=block_rows,
                           **check_projection(kern, ref, pairs_in, weights[name], ids, block_rows))
                table.append(row)
                if row["differing"] or row["torch_vs_jax"]:
                    failures.append(f"FAIL {row}")
                if t == control_t and kind == "random":
                    control = check_projection(kern, ref, pairs_in, weights[name], ids, block_rows,
                                               shift=1)
                    table.append(dict(row, routing="random, map shifted (control)", **control))
                    if not control["differing"]:
                        failures.append(f"FAIL control found no difference: {row}")
    return table, failures


def median_ms(fn, *args, iters: int) -> float:
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def timings(kern, dims, tokens, iters: int, rng) -> list[dict]:
    """One layer's experts, routed vs dense (every expert on every row, then the slot
    selection), each folded in slot order: ms medians."""
    h, i, e, k = dims["hidden"], dims["inter"], dims["experts"], dims["top_k"]
    keys = jax.random.split(jax.random.key(7), 3)
    gw, uw = ((jax.random.normal(key, (e, h, i), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
              for key in keys[:2])
    dw = (jax.random.normal(keys[2], (e, i, h), jnp.float32) / np.sqrt(i)).astype(jnp.bfloat16)

    # The weights are arguments, never closed over: a closure makes them constants of the
    # executable (1.2 GB at E 128), and the last two H200 runs spent their whole step compressing
    # that into the persistent compilation cache.
    @jax.jit
    def routed(x, ids, w, gw, uw, dw):
        return slot_order_sum(routed_expert_outputs(kern, x, ids, w, gw, uw, dw,
                                                    dtype=jnp.bfloat16)).astype(jnp.bfloat16)

    @jax.jit
    def dense(x, ids, w, gw, uw, dw):
        """The path moe.py ran before the routed one: every expert on every row, the weight
        inside the activation. One expert per iteration of a scan (three gemm launches each):
        the same work as moe.py's unrolled launches, but one compiled body instead of 3E, which
        at E = 128 did not finish compiling within a device step."""
        row_w = expert_row_weights(ids, w.astype(jnp.bfloat16), e)                   # [E, T]

        def one_expert(_, args):
            g, u, d, rw = args
            gate = kern.gemm(x, g, None, out_dtype=jnp.bfloat16)
            up = kern.gemm(x, u, None, out_dtype=jnp.bfloat16)
            return None, kern.gemm(kern.silu(gate) * up * rw[:, None], d, None,
                                   out_dtype=jnp.bfloat16)

        _, per_expert = jax.lax.scan(one_expert, None, (gw, uw, dw, row_w))      # [E, T, H]
        selected = per_expert[ids, jnp.arange(x.shape[0])[:, None]]
        return slot_order_sum(selected).astype(jnp.bfloat16)

    rows = []
    for t in tokens:
        x = jax.random.normal(jax.random.key(t), (t, h), jnp.float32).astype(jnp.bfloat16)
        ids = jnp.asarray(routing("random", t, e, k, rng))
        w = jnp.asarray(rng.random((t, k)), jnp.float32)
        # Progress with wall times: the last two device calls ran out of time here with nothing
        # printed, so each phase says when it starts.
        start = time.perf_counter()
        print(f"timing T={t}: routed ...", flush=True)
        r = median_ms(routed, x, ids, w, gw, uw, dw, iters=iters)
        print(f"timing T={t}: routed {r:.3f} ms ({time.perf_counter() - start:.0f} s); dense ...",
              flush=True)
        d = median_ms(dense, x, ids, w, gw, uw, dw, iters=iters)
        rows.append(dict(T=t, routed_ms=round(r, 3), dense_ms=round(d, 3),
                         dense_over_routed=round(d / r, 2)))
        # Printed as it comes: the dense side compiles one GEMM per expert per T, so a step that
        # runs out of time still reports the rows it finished.
        print(f"timing {rows[-1]}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help=f"widths {SMALL} (CPU checks)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="T of the bit checks")
    ap.add_argument("--timing-ts", type=int, nargs="*", default=None,
                    help="T of the timings (default 1 64 512 4096; none with --small)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-bits", action="store_true", help="timings only")
    ap.add_argument("--watchdog", type=float, default=0,
                    help="dump every thread's stack after this many seconds (0: never)")
    args = ap.parse_args()
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=False)
    import torch

    dims = SMALL if args.small else QWEN3_30B_A3B
    tokens = tuple(args.tokens or (SMALL_TOKENS if args.small else TOKENS))
    timing_ts = tuple(args.timing_ts if args.timing_ts is not None
                      else (() if args.small else (1, 64, 512, 4096)))
    hardware = "gpu" if args.device == "cuda" else "cpu"
    kern = kernels(hardware)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, jax {jax.__version__} on {jax.default_backend()}, device: "
          f"{where}; grouped leaf {kern.grouped_gemm.leaf.impl}, gemm leaf {kern.gemm.leaf.impl}")
    rng = np.random.default_rng(0)
    table, failures = ([], []) if args.skip_bits else check_bits(
        kern, reference_gemm(kern, args.device), dims, tokens, rng)
    print(f"bits: {sum(r['differing'] for r in table if 'control' not in r['routing'])} rows "
          f"differ; failures: {failures or 'none'}", flush=True)
    times = timings(kern, dims, timing_ts, args.iters, rng)
    for rows in (table, times):
        if rows:
            cols = list(rows[0])
            print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
            for row in rows:
                print("| " + " | ".join(str(row.get(c)) for c in cols) + " |")
    print("\n".join(failures) or ("bits not checked (--skip-bits)" if args.skip_bits else
                                   "PASS: every routed row has the dense leaf's bits"))
    summary = {"check": "grouped_gemm", "device": where, "dims": dims,
               "leaf": kern.grouped_gemm.leaf.impl,
               "pass": None if args.skip_bits else not failures,
               "rows_checked": sum(r["rows"] for r in table if "control" not in r["routing"]),
               "differing": sum(r["differing"] for r in table if "control" not in r["routing"]),
               "timing_ms": {r["T"]: [r["routed_ms"], r["dense_ms"]] for r in times}}
    print(json.dumps(summary))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "grouped_gemm.json"), "w") as f:
            json.dump({"summary": summary, "bits": table, "timings": times,
                       "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
