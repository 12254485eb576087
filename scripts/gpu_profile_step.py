"""Where one decode step's time goes: a jax.profiler trace of the real ModelRunner, summed by kernel.

    python scripts/gpu_profile_step.py --numerics auto --batch 64 [--context 1024] [--out DIR]
    python scripts/gpu_profile_step.py --numerics auto --prefill 4096   # one prefill chunk instead

Builds the Llama-3-8B-shaped random-weight model of `jengine bench`, runs --steps decode steps
under jax.profiler with a Perfetto trace, and sums the device events by name (no xprof needed).
Writes profile_<numerics>_bs<batch>.md (top kernels, their share of the device time) to --out;
with --prefill N, profile_<numerics>_prefill<N>.md: one request's N-token chunk, as `jengine bench`
times it (LM head on the last row only).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_runner(numerics: str, batch: int, context: int, shape: str, prefill: int = 0):
    from jengine.bench.common import random_runner
    from jengine.config import LaunchConfig

    launch = LaunchConfig(numerics=numerics, max_running_requests=batch,
                          max_prefill_tokens=max(prefill, 16),
                          context_length=max(context, prefill) + 16,
                          max_total_tokens=(batch + 1) * (max(context, prefill) + 16),
                          skip_warmup=True)
    return random_runner(shape, numerics, launch)[0]


def host_dispatch(runner, batch, n: int) -> dict:
    """How long each of the step's calls takes to return with the device idle, and where the
    Python side of that time goes."""
    import cProfile
    import io
    import pstats
    import statistics

    import jax

    times = collections.defaultdict(list)
    for _ in range(n):
        t0 = time.perf_counter()
        hidden = runner.forward_padded(batch)
        t1 = time.perf_counter()
        logits = runner.logits_at(hidden, batch.hidden_rows)
        t2 = time.perf_counter()
        jax.block_until_ready(logits)
        times["forward_padded"].append((t1 - t0) * 1e3)
        times["logits_at"].append((t2 - t1) * 1e3)
    prof = cProfile.Profile()
    calls = 10
    for _ in range(calls):
        prof.enable()
        logits = runner.logits_at(runner.forward_padded(batch), batch.hidden_rows)
        prof.disable()
        jax.block_until_ready(logits)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return {"ms": {k: statistics.median(v) for k, v in times.items()}, "calls": calls,
            "python": text.getvalue().strip()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--numerics", default="auto")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prefill", type=int, default=0,
                   help="profile one request's N-token prefill chunk instead of a decode step")
    p.add_argument("--shape", default="llama3-8b", help="small: a CPU smoke test of this script")
    p.add_argument("--tag", default="", help="suffix of the output file (e.g. an XLA flag variant)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    import jax
    import numpy as np

    from jengine.engine.batch import StepBatch

    if args.prefill:
        args.batch = 1
    runner = build_runner(args.numerics, args.batch, args.context, args.shape, args.prefill)
    bs, ps, n = args.batch, runner.page_size, args.prefill
    if n:  # jengine.bench.model's prefill row
        batch = StepBatch(input_ids=np.arange(n) % 1000, positions=np.arange(n),
                          token_req=np.zeros(n), hidden_rows=[n - 1],
                          block_tables=1 + np.arange(-(-n // ps), dtype=np.int32)[None])
        what, tag = f"prefill chunk profile: {n} tokens of one request", f"prefill{n}"
    else:
        pages = -(-(args.context + 1) // ps)
        batch = StepBatch(input_ids=np.arange(bs) % 1000, positions=np.full(bs, args.context),
                          token_req=np.arange(bs),
                          block_tables=1 + np.arange(bs * pages, dtype=np.int32).reshape(bs, pages),
                          hidden_rows=np.arange(bs))
        what, tag = f"decode step profile: batch={bs} context={args.context}", f"bs{bs}"

    def step():
        jax.block_until_ready(runner.logits_at(runner.forward_padded(batch), batch.hidden_rows))

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    wall_ms = (time.perf_counter() - t0) / args.steps * 1e3
    dispatch = host_dispatch(runner, batch, args.steps * 4)
    logdir = f"/tmp/jprof_{args.numerics}_{tag}"
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(args.steps):
            step()
    path = sorted(glob.glob(f"{logdir}/**/*perfetto_trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = ({pid for pid, n in names.items() if "GPU" in n or "gpu" in n}
                   or set(names))  # no GPU (the CPU smoke test): every line
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    # A GPU process has several lines (streams, "XLA Ops", "XLA Modules"); each is summed apart so
    # nested events are never added to their parents.
    total = collections.Counter()
    count = collections.Counter()
    per_line = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device_pids:
            line = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
            total[(line, e["name"])] += e.get("dur", 0)
            count[(line, e["name"])] += 1
            per_line[line] += e.get("dur", 0)
    busiest = per_line.most_common(1)[0][0] if per_line else None
    device_us = per_line[busiest] / args.steps if busiest else float("nan")
    lines = [f"# {what}, numerics={args.numerics}",
             "", f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}", "", f"kernels: {runner.kernels.describe()}",
             f"wall per step (host included): {wall_ms:.2f} ms; device events per step: "
             f"{device_us / 1e3:.2f} ms on line {busiest!r}", "",
             "lines (ms/step): " + ", ".join(f"{k}: {v / args.steps / 1e3:.2f}"
                                            for k, v in per_line.most_common(8))]
    lines += ["", "## Host", "",
              ("Dispatch with the device idle (median ms; each call returns once its kernels are "
               "enqueued): " + ", ".join(f"{k} {v:.2f}" for k, v in dispatch["ms"].items())), "",
              (f"The Python side of those calls (cProfile over {dispatch['calls']} dispatches, "
               "seconds in all; the compiled call's C++ is its caller's own time):"),
              "", "```", dispatch["python"], "```", "",
              ("Host-thread trace events (inclusive ms per step: nested events are counted in "
               "their parents too):"), "", "| thread | event | ms/step | calls/step |",
              "|---|---|---|---|"]
    host = collections.Counter()
    host_n = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in device_pids:
            key = (threads.get((e["pid"], e.get("tid")), str(e.get("tid"))), e["name"])
            host[key] += e.get("dur", 0)
            host_n[key] += 1
    for (line, name), us in host.most_common(30):
        lines.append(f"| {line[:30]} | {name[:90]} | {us / args.steps / 1e3:.3f} | "
                     f"{host_n[(line, name)] / args.steps:.0f} |")
    lines += ["", "## Device", "", "| line | kernel | ms/step | share of busiest line | calls/step |",
              "|---|---|---|---|---|"]
    shown = [line for line, _ in per_line.most_common(4)]
    for (line, name), us in total.most_common():
        limit = 40 if line == busiest else 10
        if line not in shown or sum(1 for l in lines if l.startswith(f"| {line[:30]} |")) >= limit:
            continue
        lines.append(f"| {line[:30]} | {name[:90]} | {us / args.steps / 1e3:.3f} | "
                     f"{us / args.steps / device_us:.1%} | {count[(line, name)] / args.steps:.0f} |")
    md = "\n".join(lines)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_{args.numerics}_{tag}{args.tag}.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
