"""The server part's load generator: concurrent `/generate` clients, one request each, spread over
`--server-client-procs` processes.

One Python process reading 256 SSE streams (httpx, a `json.loads` per event) spent 7-12 s of CPU
in a 14-20 s run on the H200 host, so in the decode phase it fell behind the server and the run's
wall time measured the client as much as the server. Each process here runs its share of the
clients on its own event loop (even with one process, never the caller's); all start on one
signal, and the wall time is from the first process's start to the last one's end
(CLOCK_MONOTONIC, shared by the processes of one machine).

    python -m jengine.bench.clients     (a child: reads its share as JSON on stdin, prints
                                         "ready", waits for "go", prints its results as JSON)
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time


async def _client(http, url: str, ids: list[int], sampling: dict,
                  stream: bool) -> tuple[float, list, int]:
    """One request: (submit time, [(arrival, tokens so far)], tokens at the end). Unstreamed, the
    one event is the whole response."""
    events, t0 = [], time.monotonic()
    body = {"input_ids": ids, "sampling_params": sampling, "stream": stream}
    if not stream:
        resp = await http.post(url + "/generate", json=body)
        resp.raise_for_status()
        n = len(resp.json()["output_ids"])
        return t0, [(time.monotonic(), n)], n
    async with http.stream("POST", url + "/generate", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            out = json.loads(line[len("data: "):])
            events.append((time.monotonic(), len(out["output_ids"])))
    return t0, events, events[-1][1] if events else 0


async def _clients(url: str, prompts, sampling: dict, stream: bool) -> tuple[float, float, list]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        start = time.monotonic()
        results = await asyncio.gather(*(_client(http, url, ids, sampling, stream)
                                         for ids in prompts))
        return start, time.monotonic(), results


def run_clients(url: str, prompts, sampling: dict, stream: bool,
                procs: int) -> tuple[float, list, float]:
    """(wall seconds, each client's (submit time, events, tokens) in prompt order, the client
    processes' CPU seconds). Always in child processes, one too: the caller's own process (the
    bench, or scripts/stream_http_bench.py's server) keeps no client work."""
    procs = max(1, min(procs, len(prompts)))
    shares = [prompts[i::procs] for i in range(procs)]  # interleaved: each share mixes lengths
    children = [subprocess.Popen([sys.executable, "-m", "jengine.bench.clients"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
                for _ in shares]
    try:
        for child, share in zip(children, shares):
            child.stdin.write(json.dumps({"url": url, "prompts": share, "sampling": sampling,
                                          "stream": stream}) + "\n")
            child.stdin.flush()
        for child in children:  # every process imported and connected what it needs
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client process failed to start (rc={child.poll()})")
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        reports = []
        for child in children:
            line = child.stdout.readline()
            if child.wait() != 0 or not line:
                raise RuntimeError(f"a client process failed (rc={child.returncode})")
            reports.append(json.loads(line))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    results = [None] * len(prompts)
    for i, report in enumerate(reports):
        results[i::procs] = [(t0, [tuple(e) for e in events], n)
                             for t0, events, n in report["results"]]
    wall = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    return wall, results, sum(r["cpu_s"] for r in reports)


def _child() -> int:
    spec = json.loads(sys.stdin.readline())
    import httpx  # noqa: F401 -- imported before "ready": not inside the timing

    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    cpu0 = time.process_time()
    start, end, results = asyncio.run(_clients(spec["url"], spec["prompts"], spec["sampling"],
                                               spec["stream"]))
    print(json.dumps({"start": start, "end": end, "results": results,
                      "cpu_s": time.process_time() - cpu0}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child())
