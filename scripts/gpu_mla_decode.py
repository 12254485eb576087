"""MLA decode step time against a dense model of equal active parameters (issue #20).

    python3 scripts/gpu_mla_decode.py --out DIR [--layers 16] [--batch 64] [--context 1024]
    python3 scripts/gpu_mla_decode.py --out DIR --small   # a CPU run of the plumbing, tiny widths

(scripts/gpu_run.sh step `mla_decode`.) Two bench shapes of jengine/bench/common.py, both cut to
the same --layers: `dsv3-8b-active` (DeepSeek-V3's structure at the Llama-3-8B shape's active
parameters per token) and `llama3-8b` (`dsv3-small` and `small` with --small). Each (shape,
numerics) runs in its own process, as `jengine bench` parts do (a numerics' XLA flags are set
before JAX starts): the bench's random-weight ModelRunner, timed at decode by
jengine/bench/model.py's `_time_decode` (the engine's path, forward_padded then logits_at; the
median of --iters steps after a warm-up). Prints and writes mla_decode.md and mla_decode.json:
ms per step for each, the MLA / dense ratio per numerics, total and active parameters, and KV-cache
bytes per token. A child that fails or runs past --child-timeout is a row saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAIRS = {False: ("dsv3-8b-active", "llama3-8b"), True: ("dsv3-small", "small")}


def child(args) -> dict:
    """Build one runner and time its decode step (in a fresh process: the XLA flags)."""
    from jengine.bench.common import random_runner
    from jengine.bench.model import _model_launch, _time_decode

    rows = argparse.Namespace(numerics=args.numerics, batch_sizes=[args.batch],
                              context=args.context, long_context=0, prefill_tokens=0)
    t0 = time.time()
    runner, _, _ = random_runner(args.child, args.numerics, _model_launch(rows), layers=args.layers)
    build_s = time.time() - t0
    compile_s, ms = _time_decode(runner, args.batch, args.context, args.iters)[:2]
    return {"build_s": round(build_s, 1), "compile_s": round(compile_s, 1), "ms": ms,
            "kernels": runner.kernels.describe()}


def run_child(shape: str, numerics: str, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    argv = [sys.executable, __file__, "--child", shape, "--numerics", numerics,
            "--child-out", path, "--layers", str(args.layers), "--batch", str(args.batch),
            "--context", str(args.context), "--iters", str(args.iters)]
    start = time.time()
    try:
        proc = subprocess.run(argv, timeout=args.child_timeout, text=True, capture_output=True)
        if proc.returncode:
            return {"error": f"rc={proc.returncode}", "tail": (proc.stdout + proc.stderr)[-2000:]}
        with open(path) as f:
            result = json.load(f)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {args.child_timeout} s"}
    finally:
        os.unlink(path)
    result["seconds"] = round(time.time() - start, 1)
    return result


def report(results: dict, shapes: dict, args) -> list[str]:
    """The markdown table: one row per model, one ms column per numerics, then the ratio row."""
    mla, dense = list(shapes)
    numerics = list(args.numerics)
    lines = [f"MLA decode step vs dense: batch {args.batch}, context {args.context}, "
             f"{shapes[mla]['layers']} layers each, random bf16 weights, median of {args.iters} steps",
             "", "| model | params total | params active / token | KV bytes / token | "
             + " | ".join(f"{n} ms" for n in numerics) + " |",
             "|---" * (4 + len(numerics)) + "|"]

    def count(n):
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"

    def cell(r):
        return f"{r['ms']:.2f}" if "ms" in r else r["error"]

    for shape in (mla, dense):
        s = shapes[shape]
        lines.append(f"| {shape} | {count(s['total'])} | {count(s['active'])} | "
                     f"{s['kv_bytes_per_token']} | "
                     + " | ".join(cell(results[shape][n]) for n in numerics) + " |")
    ratio = [f"{results[mla][n]['ms'] / results[dense][n]['ms']:.3f}"
             if "ms" in results[mla][n] and "ms" in results[dense][n] else "-" for n in numerics]
    lines.append(f"| MLA / dense | {shapes[mla]['total'] / shapes[dense]['total']:.2f} | "
                 f"{shapes[mla]['active'] / shapes[dense]['active']:.3f} | "
                 f"{shapes[mla]['kv_bytes_per_token'] / shapes[dense]['kv_bytes_per_token']:.3f} | "
                 + " | ".join(ratio) + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--small", action="store_true", help="dsv3-small vs small (a CPU run)")
    p.add_argument("--layers", type=int, default=0,
                   help="layers of BOTH models (0: the shapes' own, 32 or 2)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--numerics", nargs="+", default=["rl-bitwise", "auto"])
    p.add_argument("--child-timeout", type=int,
                   help="seconds per (model, numerics); default 140, --small 600 (a CPU)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.numerics = args.numerics[0]
        Path(args.child_out).write_text(json.dumps(child(args), default=str))
        return 0

    args.child_timeout = args.child_timeout or (600 if args.small else 140)
    from jengine.bench.common import kv_bytes_per_token, parameter_counts, shape_config

    shapes = {}
    for shape in PAIRS[args.small]:
        base, _ = shape_config(shape, args.layers)
        shapes[shape] = {**parameter_counts(base), "kv_bytes_per_token": kv_bytes_per_token(base),
                         "layers": base["num_hidden_layers"]}
        print(f"{shape}: {shapes[shape]}", flush=True)
    results = {shape: {} for shape in shapes}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for numerics in args.numerics:
        for shape in shapes:
            r = results[shape][numerics] = run_child(shape, numerics, args)
            print(f"[{numerics}] {shape}: " + (f"{r['ms']:.2f} ms (build {r['build_s']} s, "
                                                f"compile {r['compile_s']} s)" if "ms" in r
                                                else f"{r['error']}\n{r.get('tail', '')}"),
                  flush=True)
            (out / "mla_decode.json").write_text(json.dumps(
                {"shapes": shapes, "results": results, "batch": args.batch,
                 "context": args.context, "iters": args.iters}, indent=1, default=str))
    lines = report(results, shapes, args)
    (out / "mla_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if all("ms" in r for by in results.values() for r in by.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
