"""Part `server`: --server-clients concurrent streaming `/generate` clients, one request each (the
engine part's workload), against a real server process on 127.0.0.1 serving the random-weight
model: throughput, TTFT and inter-token latency percentiles as the clients see them. The report
sets its throughput against the in-process Engine row of the same numerics.

The server process is `python -m jengine.bench.server ...`: the engine part's Engine (random
weights cannot come from a model directory, so not `jengine serve` itself) behind the very app and
uvicorn server `jengine serve` runs (jengine/server/app.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from jengine.bench.clients import run_clients
from jengine.bench.common import _checkpoint
from jengine.config import LaunchConfig
from jengine.server.gil import ENGINE_SWITCH_INTERVAL_S

STARTUP_S = 420  # model build and warm-up of the server process, inside the default part timeout
COMPILES_ROUTE = "/bench/compiles"
PHASES_ROUTE = "/bench/phases"  # the engine loop's phase clock: POST restarts it, GET reads it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args) -> None:
    """The server process: the engine part's launch and warm-up, then uvicorn until killed."""
    import uvicorn

    from jengine.bench.common import random_runner
    from jengine.bench.e2e import _CompileClock, _e2e_launch, _make_engine, _warm_step_programs
    from jengine.engine.sampler import Sampler
    from jengine.server.app import create_app
    from jengine.server.gil import favour_engine_thread
    from jengine.server.http_utils import JSONResponse

    clock = _CompileClock().__enter__()  # for the process's life: the bench reads differences
    runner, plan, loaded = random_runner(args.shape, args.numerics, _e2e_launch(args))
    sampler = Sampler(plan.sampler, loaded.config.vocab_size)
    _warm_step_programs(runner, sampler, args)
    engine = _make_engine(runner, sampler, plan, loaded)
    app = create_app(engine)

    @app.get(COMPILES_ROUTE)  # the bench's own routes, not part of the served API
    async def compiles():
        return JSONResponse({"count": clock.count, "seconds": clock.seconds})

    @app.post(PHASES_ROUTE)
    async def restart_phases():
        engine.time_host_phases()
        return JSONResponse({"ok": True})

    @app.get(PHASES_ROUTE)
    async def phases():
        # Which OS thread is which, so the bench can name the server's per-thread CPU time.
        threads = {"event loop": os.getpid(), "engine": engine._thread.native_id,
                   "output": engine.output_processor._thread.native_id}
        return JSONResponse({"phases": engine.host_phases(), "threads": threads})

    favour_engine_thread(args.switch_interval)  # as `jengine serve` does
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


def _wait_healthy(url: str, proc, deadline: float) -> None:
    import httpx

    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server process exited with rc={proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("the server did not answer /health in time")


def _uvicorn_flavour() -> str:
    """The HTTP parser and event loop uvicorn picks here ("auto": the C ones when installed);
    h11 is pure Python and costs the event loop more per streamed event than httptools."""
    import importlib.util

    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return f"{http}, {'uvloop' if importlib.util.find_spec('uvloop') else 'asyncio'}"


def part_server(args) -> dict:
    import numpy as np

    from jengine.bench.e2e import latency_stats

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "jengine.bench.server", "--port", str(port),
            "--numerics", args.numerics, "--shape", args.shape,
            "--e2e-requests", str(args.server_clients), "--e2e-input", str(args.e2e_input),
            "--e2e-output", str(args.e2e_output),
            "--switch-interval", str(args.server_switch_interval),
            "--output-hold-ms", str(args.output_hold_ms)]
    out = {"numerics": args.numerics, "shape": args.shape, "clients": args.server_clients,
           "input_tokens": args.e2e_input, "output_tokens": args.e2e_output,
           "switch_interval_s": args.server_switch_interval, "uvicorn": _uvicorn_flavour(),
           "output_hold_ms": args.output_hold_ms,
           "stream": args.server_stream == "on"}
    t0 = time.time()
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_healthy(url, proc, time.time() + STARTUP_S)
        out["startup_s"] = time.time() - t0
        _checkpoint(args, out)
        rng = np.random.default_rng(0)  # the engine part's prompts
        sampling = {"max_new_tokens": args.e2e_output, "temperature": 0.0, "ignore_eos": True}
        prompts = rng.integers(0, 32000, (args.server_clients, args.e2e_input)).tolist()
        print(f"[{args.numerics}] server workload once untimed (compiles what its steps "
              "need) ...", flush=True)
        stream = args.server_stream == "on"
        client_procs = max(1, min(args.server_client_procs, args.server_clients))
        out["client_procs"] = client_procs
        out["warm_run"] = _timed_run(url, prompts, sampling, proc.pid, stream, client_procs)[0]
        _checkpoint(args, out)
        print(f"[{args.numerics}] server workload, timed ...", flush=True)
        timed, results = _timed_run(url, prompts, sampling, proc.pid, stream, client_procs)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    out.update(timed)
    if out["stream"]:  # a whole response's one event is no token's latency
        out.update(latency_stats([t for t, _, _ in results], [e for _, e, _ in results]))
    return out


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) each thread of process `pid` has used so far, by thread id,
    from /proc (Linux); {} where there is no /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return out


def cpu_by_thread(before: dict, after: dict, names: dict[str, int]) -> dict[str, float]:
    """CPU seconds per named thread between two `thread_cpu_s` readings; the rest summed."""
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    out = {name: used.pop(tid, 0.0) for name, tid in names.items()}
    out["other threads"] = sum(used.values())
    return out


def _timed_run(url: str, prompts, sampling: dict, pid: int, stream: bool = True,
               client_procs: int = 1) -> tuple[dict, list]:
    """One run of the workload from an empty prefix cache: wall time, throughput and what the
    server compiled meanwhile; where the time went (the server's CPU per thread, the clients'
    CPU, the engine loop's phases summed over the run); and each client's (submit time, events,
    tokens)."""
    import httpx

    httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
    before = httpx.get(url + COMPILES_ROUTE, timeout=60).json()
    httpx.post(url + PHASES_ROUTE, timeout=60).raise_for_status()
    cpu0 = thread_cpu_s(pid)
    wall, results, client_cpu = run_clients(url, prompts, sampling, stream, client_procs)
    cpu1 = thread_cpu_s(pid)
    after = httpx.get(url + COMPILES_ROUTE, timeout=60).json()
    phases = httpx.get(url + PHASES_ROUTE, timeout=60).json()
    produced = sum(n for _, _, n in results)
    run = {"wall_s": wall, "output_tokens_total": produced, "output_tok_s": produced / wall,
           "req_s": len(results) / wall, "compiles_in_timing": after["count"] - before["count"],
           "compile_s_in_timing": after["seconds"] - before["seconds"],
           "server_cpu_s": cpu_by_thread(cpu0, cpu1, phases["threads"]),
           "client_cpu_s": client_cpu, "host_phases": phases["phases"]}
    print(f"  server {len(prompts)} clients: {wall:.2f} s, {run['output_tok_s']:.0f} output "
          f"tok/s, {run['compiles_in_timing']} programs compiled inside; CPU s: "
          + ", ".join(f"{k} {v:.2f}" for k, v in run["server_cpu_s"].items())
          + f", clients {client_cpu:.2f}", flush=True)
    return run, results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jengine.bench.server",
                                description="serve the bench's random-weight model")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--numerics", default="auto")
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--e2e-requests", type=int, default=256)
    p.add_argument("--e2e-input", type=int, default=1024)
    p.add_argument("--e2e-output", type=int, default=256)
    p.add_argument("--switch-interval", type=float, default=ENGINE_SWITCH_INTERVAL_S)
    p.add_argument("--output-hold-ms", type=float, default=LaunchConfig.output_hold_ms)
    _serve(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
