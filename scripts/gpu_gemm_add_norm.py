"""Does o_proj / down_proj with the layer boundary in its launch keep every bit and save time at
decode rows? (#19; pallas_kernels/triton_gemm_add_norm.py, an experimental leaf, planned on request)

    python scripts/gpu_gemm_add_norm.py [--out DIR] [--rows 1 2 4 8 16 32 64] [--smoke]

At one row an rl-bitwise step runs the boundary's add + norm as its own launch twice per layer
(64 launches of ~4.8 µs per step of an 8B model, each with a gap before it). The experiment's
launch does the fused-reduce GEMM and then, in the program that closes a row block's last tile,
norm(h + residual) for the block's rows (round_sum: the unfused boundary rl-bitwise runs).

  bits    (normed, new residual) of the one launch against the two it replaces (the engine's
          fused-reduce GEMM launch on the table's decode tile, then add_rmsnorm with round_sum),
          bf16 float bits, at every --rows; and the JAX launch against the torch one at the
          smallest and largest. Control: the two launches with the f32 sum (round_sum=False)
          must differ somewhere.
  timing  µs per layer on the device: 32 launches (a model's layers, cycling through weight
          copies so the weights come from HBM, not L2) captured in one CUDA graph and replayed,
          for the one launch and for the two; the counters are zeroed once (each launch leaves
          them zero, as in the engine's step). Each timed launch runs once first and its outputs
          are checked against the two launches' bits too.

Shapes: Llama-3-8B's o_proj (K 4096) and down_proj (K 14336), N = hidden 4096, bf16. Writes
gemm_add_norm.json / .md to --out. --smoke: the bits part under the Triton interpreter on the CPU
at tiny shapes (a logic check of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = {"o_proj": 4096, "down_proj": 14336}  # name: K (N = 4096)
LAYERS = 32
EPS = 1e-5
DEV = "cuda"


def inputs(m, k, n, seed, copies):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).to(torch.bfloat16)
    ws = [(torch.randn(k, n, generator=g) * k ** -0.5).to(torch.bfloat16).to(DEV)
          for _ in range(copies)]
    res = (torch.randn(m, n, generator=g) * 4).to(torch.bfloat16)
    nw = (1 + torch.randn(n, generator=g) / 10).to(torch.bfloat16)
    return x.to(DEV), ws, res.to(DEV), nw.to(DEV)


def write_report(out_dir, name, result, lines) -> None:
    """result as <name>.json, the table `lines` as <name>.md (and on stdout)."""
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def bits_differ(a, b) -> int:
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


def device_us_per_layer(launch, copies) -> float:
    """µs per layer: LAYERS launches (weight copy i % copies) in one CUDA graph, replayed."""
    if DEV == "cpu":
        return float("nan")
    for i in range(copies):
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            launch(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = 20
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / LAYERS * 1e3


def runners(x, ws, res, nw, tile):
    """(one launch, two launches, (normed, new residual)): callables of the weight copy index on
    buffers made once, both writing their results to the same two buffers."""
    from pallas_kernels import triton_gemm as tg
    from pallas_kernels import triton_gemm_add_norm as ga
    from pallas_kernels import triton_norm as tn

    m, k = x.shape
    n = ws[0].shape[1]
    _, _, _, grid, consts = ga._plan(x, ws[0], None, res, nw, True, tile)
    sems = torch.zeros(ga._counters(m, n, tile).size, dtype=torch.int32, device=x.device)
    parts = torch.empty((tile.k_split, m, n), dtype=torch.float32, device=x.device)
    h, normed, new_res = (torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
                          for _ in range(3))
    launch = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)

    def one(i):
        tg.torch_launch(ga.kernels().gemm_add_rmsnorm_kernel,
                        (x, ws[i], ws[i], res, nw, EPS, m, sems),
                        (parts, h, normed, new_res, sems), grid, **launch, **consts)

    (g_grid, g_consts), _ = tg._launches(m, k, n, x.dtype, None, tile, "split")
    g_sems = torch.zeros(g_grid[0], dtype=torch.int32, device=x.device)
    norm_consts, norm_warps = tn._launch_params(n)

    def two(i):
        tg.torch_launch(tg.kernels().fixed_tile_gemm_fused_kernel,
                        (x, ws[i], ws[i], m, g_sems), (parts, h, g_sems), g_grid, **launch,
                        **tg._fused(g_consts))
        tn.torch_launch(tn.kernels().add_rmsnorm_kernel, (h, res, nw, EPS), (normed, new_res),
                        (m,), num_warps=norm_warps, num_stages=1, ROUND_SUM=True, **norm_consts)

    return one, two, (normed, new_res)


def jax_matches_torch(x, w, res, nw, tile) -> int | None:
    """Bits differing between the JAX launch and the torch one (None: no JAX GPU here)."""
    try:
        import jax
        import jax.numpy as jnp

        if jax.default_backend() != "gpu":
            return None
    except Exception:  # noqa: BLE001 - no usable JAX here
        return None
    from pallas_kernels import triton_gemm_add_norm as ga

    want = ga.gemm_add_rmsnorm_triton_torch(x, w, None, res, nw, eps=EPS, tile=tile)
    j = [jnp.from_dlpack(t) for t in (x, w, res, nw)]
    got = jax.jit(lambda a, b, c, d: ga.gemm_add_rmsnorm_triton(a, b, None, c, d, eps=EPS,
                                                                tile=tile))(*j)
    return sum(bits_differ(torch.from_dlpack(g), t) for g, t in zip(got, want))


def main() -> int:
    global DEV
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gemm_add_norm"))
    p.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = p.parse_args()
    if args.smoke:  # before any @triton.jit source is imported: the interpreter is chosen then
        from tests import triton_interpreter  # noqa: F401
        DEV = "cpu"
    from pallas_kernels import triton_gemm as tg
    from pallas_kernels import triton_gemm_add_norm as ga
    from pallas_kernels import triton_norm as tn
    from pallas_kernels.triton_gemm_tiles import GemmTile

    shapes = {"tiny": 256} if args.smoke else SHAPES
    n = 80 if args.smoke else 4096
    rows = [1, 20] if args.smoke else args.rows
    os.makedirs(args.out, exist_ok=True)
    result = []
    for name, k in shapes.items():
        copies = 1 if args.smoke else max(2, -(-256 * 2 ** 20 // (k * n * 2)))  # > L2: 256 MiB
        for m in rows:
            x, ws, res, nw = inputs(m, k, n, seed=m + k, copies=copies)
            tile = (GemmTile(16, 32, 32, k_split=4, fused_reduce=True) if args.smoke
                    else tg.tile_for(n, k, torch.bfloat16, m))
            row = dict(shape=name, m=m, tile=tile.describe())
            try:
                got = ga.gemm_add_rmsnorm_triton_torch(x, ws[0], None, res, nw, eps=EPS, tile=tile)
            except ValueError as exc:  # a tile without a fused reduce: not this launch's M
                row["error"] = str(exc)
                result.append(row)
                print(row, flush=True)
                continue
            h = tg.gemm_triton_torch(x, ws[0], out_dtype=torch.bfloat16, tile=tile,
                                     schedule="split")
            want = tn.add_rmsnorm_triton_torch(h, res, nw, eps=EPS, round_sum=True)
            control = tn.add_rmsnorm_triton_torch(h, res, nw, eps=EPS, round_sum=False)
            row.update(normed_differ=bits_differ(got[0], want[0]),
                       residual_differ=bits_differ(got[1], want[1]),
                       control_differ=bits_differ(control[0], want[0]))
            if m in (rows[0], rows[-1]) and not args.smoke:
                row["jax_vs_torch_differ"] = jax_matches_torch(x, ws[0], res, nw, tile)
            one, two, outs = runners(x, ws, res, nw, tile)
            for label, run in (("one", one), ("two", two)):
                # the timed launches, once on weight copy 0: the bits checked above, or the
                # timing measures something else
                run(0)
                row[f"timed_{label}_differ"] = sum(bits_differ(o, t) for o, t in zip(outs, want))
                row[f"{label}_us"] = device_us_per_layer(run, copies)
            print(row, flush=True)
            result.append(row)
    lines = ["| shape | M | tile | normed / residual bits differing | control (f32 sum) differs | "
             "JAX vs torch | one launch µs/layer | two launches µs/layer |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['m']} | {r['tile']} | {r['error']} | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['m']} | {r['tile']} | {r['normed_differ']} / "
                     f"{r['residual_differ']} (timed launches: {r['timed_one_differ']} / "
                     f"{r['timed_two_differ']}) | {r['control_differ']} | "
                     f"{r.get('jax_vs_torch_differ', '-')} | {r['one_us']:.1f} | "
                     f"{r['two_us']:.1f} |")
    write_report(args.out, "gemm_add_norm", result, lines)
    checked = [r for r in result if "error" not in r]
    bad = [r for r in checked if r["normed_differ"] or r["residual_differ"]
           or r.get("jax_vs_torch_differ") or r["timed_one_differ"] or r["timed_two_differ"]]
    no_control = [r for r in checked if r["control_differ"] == 0]
    print("gemm_add_norm:", "FAIL" if bad or no_control or not checked else "PASS")
    return 1 if bad or no_control or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
