"""Where a MoE decode step's first call spends its time: weights, tracing, XLA's compile, the run.

    python3 scripts/gpu_moe_compile.py --out DIR [--shape qwen3-30b-a3b] [--layers 2 4]
    python3 scripts/gpu_moe_compile.py --out DIR --shape qwen3-moe-small --layers 1 2   # CPU

(scripts/gpu_run.sh step `moe_compile`.) On an H100 the first bs 1 decode step of Qwen3-30B-A3B's
first 8 layers had not returned after 83 s in either numerics (forty-third session), where the
Llama-3-8B shape's 32 layers compile and run in ~10 s. This splits that first call of the bench's
random-weight ModelRunner (jengine/bench/common.py random_runner) into: the weights drawn and
resident; the step program traced and lowered (with its StableHLO's size); XLA's compile; the
first run; a second run. Each (numerics, layers) runs in its own process (a numerics' XLA flags
are set before JAX starts) with JAX_LOG_COMPILES=1, and its output is passed on line by line, so
a run cut short by its limit still shows the phase it was in and every program compiled so far.
Writes moe_compile.md and moe_compile.json. The last argument of --layers that finishes bounds
how the time grows with depth.

A --numerics entry may also be a variant of one (VARIANTS): `auto-noautotune` is auto with XLA's
GEMM autotuning off (`--xla_gpu_autotune_level=0`, which rl-bitwise always sets), so one call
says whether auto's compile time is its autotuner's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jengine.bench.common import _read_partial, run_streamed  # noqa: E402

PHASES = ("build_s", "lower_s", "compile_s", "first_run_s", "second_run_ms")
# variant -> (numerics, XLA flags appended to the environment's before JAX starts)
VARIANTS = {"auto-noautotune": ("auto", "--xla_gpu_autotune_level=0")}


def child(args) -> dict:
    label = args.numerics
    args.numerics, flags = VARIANTS.get(label, (label, ""))
    if flags:  # before JAX starts; the numerics' own flags are appended to these
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    import jax

    from jengine.bench.common import _checkpoint, random_runner
    from jengine.bench.model import _decode_batch, _model_launch

    rows = argparse.Namespace(numerics=args.numerics, batch_sizes=[args.batch],
                              context=args.context, long_context=0, prefill_tokens=0)
    out = {}

    def phase(name, t0, scale=1.0, **extra):
        out[name] = round((time.time() - t0) * scale, 2)
        out.update(extra)
        print(f"[{label}, {args.layers} layers] {name} {out[name]}"
              + "".join(f", {k} {v}" for k, v in extra.items()), flush=True)
        _checkpoint(args, out)  # what is known so far survives a kill

    t0 = time.time()
    runner, _, _ = random_runner(args.shape, args.numerics, _model_launch(rows),
                                 layers=args.layers)
    jax.block_until_ready(runner.params.arrays)
    # the XLA flags the backend started with: the numerics' own and a variant's
    phase("build_s", t0, kernels=runner.kernels.describe().get("expert_backend"),
          xla_flags=os.environ.get("XLA_FLAGS", ""))
    inputs = runner.padded_inputs(_decode_batch(runner, args.batch, args.context))
    pool = runner.kv_pool
    t0 = time.time()
    lowered = runner._forward.lower(runner._params, pool.arrays, *inputs)
    phase("lower_s", t0, stablehlo_lines=lowered.as_text().count("\n"))
    t0 = time.time()
    compiled = lowered.compile()
    phase("compile_s", t0)
    t0 = time.time()
    hidden, pool.arrays, *_ = compiled(runner._params, pool.arrays, *inputs)
    jax.block_until_ready(hidden)
    phase("first_run_s", t0)
    t0 = time.time()
    hidden, pool.arrays, *_ = compiled(runner._params, pool.arrays, *inputs)
    jax.block_until_ready(hidden)
    phase("second_run_ms", t0, scale=1e3)
    return out


def _slow_compile(line: str) -> bool:
    """A JAX_LOG_COMPILES line of a compile that took >= 0.5 s (the weights' many small eager
    programs stay out of the log)."""
    if not line.startswith("Finished XLA compilation"):
        return False
    try:
        return float(line.rsplit(" in ", 1)[1].split()[0]) >= 0.5
    except (IndexError, ValueError):
        return True


def run_child(numerics: str, layers: int, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    argv = [sys.executable, __file__, "--child", "--numerics", numerics, "--child-out", path,
            "--shape", args.shape, "--layers", str(layers), "--batch", str(args.batch),
            "--context", str(args.context)]
    returncode, lines, _ = run_streamed(
        argv, args.child_timeout, merge_stderr=True,
        env={**os.environ, "JAX_LOG_COMPILES": "1", "PYTHONUNBUFFERED": "1"},
        show=lambda line: line.startswith("[") or _slow_compile(line))
    result = _read_partial(path)
    os.unlink(path)
    result.pop("partial", None)
    if returncode != 0:
        error = (f"stopped after {args.child_timeout:g} s" if returncode is None
                 else f"rc={returncode}")
        result.update(error=error, tail="".join(lines)[-2000:])
    return result


def render(rows: list[dict], shape: str) -> str:
    md = [f"# The first MoE decode step, phase by phase ({shape})", "",
          "| numerics | layers | experts | weights s | trace + lower s | StableHLO lines | "
          "XLA compile s | first run s | second run ms | note |", "|---" * 10 + "|"]
    for r in rows:
        cells = [r.get(k, "-") for k in ("build_s", "lower_s", "stablehlo_lines", "compile_s",
                                          "first_run_s", "second_run_ms")]
        md.append(f"| {r['numerics']} | {r['layers']} | {r.get('kernels', '-')} | "
                  + " | ".join(map(str, cells)) + f" | {r.get('error', '')} |")
    return "\n".join(md) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--numerics", nargs="+", default=["auto", "rl-bitwise"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--child-timeout", type=float, default=120.0)
    p.add_argument("--child", action="store_true")
    p.add_argument("--child-out")
    args = p.parse_args()
    if args.child:
        args.numerics, args.layers = args.numerics[0], args.layers[0]
        child(args)
        return 0
    rows = []
    os.makedirs(args.out, exist_ok=True)
    for layers in args.layers:
        for numerics in args.numerics:
            rows.append({"numerics": numerics, "layers": layers,
                         **run_child(numerics, layers, args)})
            md = render(rows, args.shape)
            Path(args.out, "moe_compile.md").write_text(md)
            Path(args.out, "moe_compile.json").write_text(json.dumps(rows, indent=1))
    print(md)
    return 0 if not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
