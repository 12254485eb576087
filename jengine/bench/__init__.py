"""`jengine bench`: decode/prefill cost on the accelerator, against a roofline measured in the same run.

    jengine bench [--parts roofline leaves model engine hf] [--numerics auto rl-bitwise] [--out DIR]
    jengine bench --merge run1/bench.json run2/bench.json --out DIR   # one report from several runs
    jengine bench ... --compare previous/bench.json   # and every row's ratio against a previous run

Parts, each run in its own subprocess with its own --part-timeout (XLA flags differ per --numerics
and must be set before the backend starts); `model` and `engine` run once per --numerics:
  roofline  HBM copy bandwidth (a warmed 4 GiB copy, bytes read + written) and bf16 8192^3 GEMM
            TFLOP/s, through XLA and, when installed, torch.
  leaves    every Llama-3-8B projection GEMM at M in {1, 16, 64, 256, 4096}: XLA's dot (what
            --numerics auto plans) against the fixed-tile Triton leaf (what rl-bitwise plans on a
            GPU), each timed over a chain of distinct weight matrices (no L2 reuse) inside one jit;
            summed into the GEMM share of one decode step (32 layers + LM head).
  model     the real ModelRunner on a Llama-3-8B-shaped model with random bf16 weights created on
            the device: decode steps at each batch size with context --context, one decode row at
            --long-context-batch x --long-context (bs 16, ctx 8192), and one prefill chunk of
            --prefill-tokens.
  engine    the whole Engine (scheduler, runner, sampler, output thread) on the same random model:
            --e2e-requests requests of --e2e-input random prompt tokens and --e2e-output greedy
            output tokens (ignore_eos), all submitted at once and streamed; wall time to the last
            one finished, TTFT and inter-token latency percentiles; with the overlap schedule
            (the default) and without; then the loop overhead at --loop-batch decode rows (the
            Engine's step against the model's own step).
  server    --server-clients streaming /generate clients against a server process on 127.0.0.1
            (the same model and workload, the real app): throughput against the engine row,
            TTFT and inter-token latency percentiles.
  hf        the peer: HF transformers' class of the same shape (LlamaForCausalLM, ...), random
            weights, greedy `generate` (static cache when it works) at --hf-batch x --context +
            --hf-new-tokens.
Every time is the median of --iters timed runs after warm-up (engine: one timed run). Writes
bench.json and bench.md (results: docs/performance.md). --shape small runs all of it on a CPU.
--shape qwen3-30b-a3b is issue 8's MoE shape (qwen3-moe-small its CPU smoke test): its decode rows
count the (layer, expert) pairs each step routes to, which its HBM bound reads (measures.row_bytes).
--layers N runs the model part on a shape's first N layers (same widths), where a whole one does
not fit a part's time. A part's output is passed on as it runs, and the model part says when its
model is built and each step compiled: a part stopped by its timeout shows how far it got.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from jengine.bench.common import LLAMA3_8B, PADDED_VOCAB, ROWS, SHAPES, SMALL  # noqa: F401
from jengine.bench.common import _read_partial, run_streamed
from jengine.bench.device import part_leaves, part_roofline
from jengine.bench.e2e import part_engine, part_hf
from jengine.bench.measures import ROOFLINE_SHAPE
from jengine.bench.model import part_model
from jengine.bench.server import part_server
from jengine.config import LaunchConfig
from jengine.server.gil import ENGINE_SWITCH_INTERVAL_S

PARTS = {"roofline": part_roofline, "leaves": part_leaves, "model": part_model,
         "engine": part_engine, "server": part_server, "hf": part_hf}
PER_NUMERICS = ("model", "engine", "server")  # parts run once per --numerics; the others once


# -- orchestration ---------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    p.add_argument("--numerics", nargs="+", default=["auto", "rl-bitwise"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--context", type=int, default=1024,
                   help="decode context length (model), prompt length (hf)")
    p.add_argument("--long-context", type=int, default=8192,
                   help="context of the extra long-context decode row (model; 0 = skip)")
    p.add_argument("--long-context-batch", type=int, default=16, help="batch of that row")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="prefill chunk (0 = skip)")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="GEMM M values (leaves)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement")
    p.add_argument("--tile-candidates", nargs="*", default=[],
                   help="extra Triton GEMM tiles for the leaves part, as BM,BN,BK,GROUP_M,WARPS,STAGES"
                        "[,KSPLIT][:split|:serial] (a schedule forced at every M)")
    p.add_argument("--leaf-shapes", nargs="*", default=[],
                   help="leaves: only these projection shapes (q/o_proj k/v_proj gate/up_proj "
                        "down_proj lm_head); default all")
    p.add_argument("--e2e-requests", type=int, default=256, help="engine: requests submitted at once")
    p.add_argument("--e2e-input", type=int, default=1024, help="engine: prompt tokens per request")
    p.add_argument("--e2e-output", type=int, default=256, help="engine: output tokens per request")
    p.add_argument("--loop-batch", type=int, default=64,
                   help="engine: decode rows of the loop-overhead row (0 = skip)")
    p.add_argument("--server-clients", type=int, default=256,
                   help="server: concurrent /generate clients, one request each (the engine "
                        "part's workload: --e2e-input / --e2e-output tokens)")
    p.add_argument("--server-client-procs", type=int, default=4,
                   help="server: processes the clients are spread over (one Python process "
                        "reading 256 streams falls behind the server; jengine/bench/clients.py)")
    p.add_argument("--server-stream", choices=("on", "off"), default="on",
                   help="server: off = the clients ask for whole responses, not streams (a "
                        "diagnosis: what streaming's per-token events cost the server; no TTFT / "
                        "ITL then)")
    p.add_argument("--server-switch-interval", type=float, default=ENGINE_SWITCH_INTERVAL_S,
                   help="server: the server process's GIL switch interval in seconds (`jengine "
                        "serve` sets %(default)s; 0.005 is CPython's default)")
    p.add_argument("--output-hold-ms", type=float, default=LaunchConfig.output_hold_ms,
                   help="engine, server: the launch's --output-hold-ms (how long the output "
                        "processor may wait for the engine thread to reach its device wait; 0 = "
                        "deliver at once; jengine/engine/host_gate.py)")
    p.add_argument("--hf-batch", type=int, default=64, help="hf: generate batch")
    p.add_argument("--hf-new-tokens", type=int, default=64, help="hf: tokens generated per row")
    p.add_argument("--part-timeout", nargs="+", default=["540"], metavar="[PART=]SECONDS",
                   type=_timeout_entry,
                   help="seconds per child process: one number for all, PART=SECONDS to override "
                        "one part (e.g. 300 engine=540)")
    p.add_argument("--shape", default="llama3-8b", choices=list(SHAPES),
                   help="model shape for the model, engine, server and hf parts (small, "
                        "qwen3-moe-small: CPU smoke tests)")
    p.add_argument("--layers", type=int, default=0,
                   help="model: the shape's first N layers, same widths (0 = all of them): a "
                        "shorter model where a whole one does not fit a part's time. Its roofline "
                        "counts those layers; not for the llama3-8b shape, whose goals count 32")
    p.add_argument("--merge", nargs="+", metavar="BENCH_JSON",
                   help="run nothing: merge bench.json files of separate runs (later ones win per "
                        "part) and render them together into --out")
    p.add_argument("--compare", metavar="BENCH_JSON",
                   help="also print (and append to bench.md) every row's new / old ratio against "
                        "a previous run's bench.json")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p


def add_parser(subparsers):
    return add_arguments(subparsers.add_parser("bench", help="benchmark on the accelerator",
                                               description=__doc__.split("\n\n")[0]))


# Options a child needs, forwarded as given (--numerics is forwarded one value per child).
CHILD_OPTIONS = ("batch_sizes", "context", "long_context", "long_context_batch", "prefill_tokens",
                 "rows", "iters", "tile_candidates", "leaf_shapes", "e2e_requests", "e2e_input",
                 "e2e_output", "loop_batch", "server_clients", "server_client_procs", "server_stream",
                 "server_switch_interval", "output_hold_ms", "hf_batch", "hf_new_tokens", "shape",
                 "layers")


def _child_argv(args) -> list[str]:
    argv = []
    for name in CHILD_OPTIONS:
        value = getattr(args, name)
        values = value if isinstance(value, list) else [value]
        argv += ["--" + name.replace("_", "-"), *map(str, values)]
    return argv


def part_timeouts(values: list[str]) -> dict:
    """['300', 'engine=540'] -> {'': 300, 'engine': 540}; '' is the default for every part."""
    out = {"": 540}
    for v in values:
        part, _, seconds = v.rpartition("=")
        if part and part not in PARTS:
            raise ValueError(f"--part-timeout {v!r}: {part!r} is not one of {list(PARTS)}")
        out[part] = int(seconds)
    return out


def _timeout_entry(value: str) -> str:
    try:
        part_timeouts([value])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _child_command(part: str, numerics: str, path: str, args) -> list[str]:
    return [sys.executable, "-m", "jengine.bench", "--child", part, "--child-out", path,
            "--numerics", numerics, *_child_argv(args)]


def _run_child(part: str, numerics: str, args) -> dict:
    """Run one part in its own process under its timeout. The child's stdout is passed on line by
    line as it comes, not at its end: a device call cut short (the step's own limit) still has in
    its log how far each part got."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    timeouts = part_timeouts(args.part_timeout)
    timeout = timeouts.get(part, timeouts[""])
    start = time.time()
    returncode, out, err = run_streamed(_child_command(part, numerics, path, args), timeout,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    error = (f"timeout after {timeout} s" if returncode is None
             else f"rc={returncode}" if returncode else None)
    try:
        result = _read_partial(path)
    finally:
        os.unlink(path)
    if error:
        tail = "".join(out) + ("".join(err) if error.startswith("rc=") else "")
        return {**result, "error": error, "tail": tail[-3000:]}
    result.pop("partial", None)
    result["seconds"] = round(time.time() - start, 1)
    return result


def _versions() -> dict:
    import datetime
    import importlib.metadata as md
    import platform

    v = {"date": datetime.datetime.now().isoformat(timespec="minutes"),
         "python": platform.python_version()}
    for name in ("jax", "jaxlib", "torch", "transformers", "triton", "jax-triton", "flax"):
        try:
            v[name] = md.version(name)
        except md.PackageNotFoundError:
            v[name] = None
    return v


def merge_results(paths: list[str]) -> dict:
    """One results dict from several bench.json files (separate device calls); later files win."""
    merged = {"commands": []}
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        merged["commands"] += r.pop("commands", None) or [r.pop("command", path)]
        merged.update(r)
    return merged


def _write(results: dict, out_dir: str, compare: str | None = None) -> str:
    from jengine.bench.report import render

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    md = render(results)
    if compare:
        from jengine.bench.compare import render_comparison

        with open(compare) as f:
            md += "\n" + render_comparison(json.loads(json.dumps(results, default=str)),
                                           json.load(f), compare)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(md)
    return md


def check_layers(args) -> None:
    """--layers shortens the model part only, and only off the shape the goals are set on (its byte
    counts are measures.py's constants for all 32 layers): refuse what it would not apply to."""
    if not args.layers or args.merge:
        return
    if args.layers < 0:
        raise SystemExit(f"--layers {args.layers}: a layer count is >= 1 (0 = all of them)")
    others = [p for p in args.parts if p not in ("model", "roofline")]
    if others:
        raise SystemExit(f"--layers {args.layers} shortens the model part only; the parts "
                         f"{others} would run the whole shape: run them in a separate bench")
    if args.shape == ROOFLINE_SHAPE:
        raise SystemExit(f"--layers {args.layers}: not for --shape {ROOFLINE_SHAPE}, whose goals "
                         "and byte counts are for all its layers")
    whole = SHAPES[args.shape][0]["num_hidden_layers"]
    if args.layers > whole:
        raise SystemExit(f"--layers {args.layers}: --shape {args.shape} has {whole} layers")


def main(args) -> int:
    check_layers(args)
    if args.merge:
        results = merge_results(args.merge)
    else:
        results = {"versions": _versions(), "command": "jengine bench " + " ".join(sys.argv[2:])}
        for part in args.parts:
            for numerics in (args.numerics if part in PER_NUMERICS else ["-"]):
                key = part if numerics == "-" else f"{part}:{numerics}"
                print(f"== {key}", flush=True)
                results[key] = _run_child(part, numerics if numerics != "-" else "auto", args)
    print(_write(results, args.out, args.compare))
    return 0 if not any("error" in v for v in results.values() if isinstance(v, dict)) else 1


def _child_main(argv) -> int:
    p = add_arguments(argparse.ArgumentParser())
    p.add_argument("--child", required=True, choices=list(PARTS))
    p.add_argument("--child-out", required=True)
    args = p.parse_args(argv)
    args.numerics = args.numerics[0]
    result = PARTS[args.child](args)
    with open(args.child_out, "w") as f:
        json.dump(result, f, default=str)
    return 0
