"""What streaming costs the serving process's event loop per token, over real HTTP, on the CPU.

    python scripts/stream_http_bench.py [--streams 256] [--tokens 256] [--step-ms 20] [--profile F]

The server's gap to the in-process Engine is the event loop's CPU per streamed token, which holds
the GIL the engine thread needs (docs/performance.md, eleventh session). This measures that path
alone: the real app (`create_app` over the embedded tiny model's Engine) under uvicorn on
127.0.0.1, with the engine's `submit` swapped for a stand-in whose thread offers every request
one new token per `--step-ms` as the output processor does (`build_output`'s dict shape, the
text growing with the ids), and `--streams` streaming `/generate` clients in a separate process
reading the SSE events. Printed: the event loop thread's CPU µs per event it sent, events per
request (fewer than tokens when readers fall behind), and the clients' wall time. `--profile F`
writes a cProfile of the event loop thread (pstats format) for `python -m pstats F`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Producer:
    """Stands in for the engine: keeps each submission's callback, and a thread that offers every
    live request its next cumulative output each step."""

    def __init__(self, tokens: int, step_s: float):
        self.tokens, self.step_s = tokens, step_s
        self.live: dict[str, list] = {}  # rid -> [on_output, prompt_len, ids]
        self.lock = threading.Lock()
        self.offered = 0
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, *, rid, on_output, input_ids, **_):
        with self.lock:
            self.live[rid] = [on_output, len(input_ids), []]

    def abort_many(self, rids, message=""):
        with self.lock:
            return sum(self.live.pop(r, None) is not None for r in rids)

    def _run(self) -> None:
        while True:
            time.sleep(self.step_s)
            with self.lock:
                items = list(self.live.items())
            for rid, entry in items:
                on_output, prompt_len, ids = entry
                ids.append(1000 + len(ids) % 7000)
                done = len(ids) >= self.tokens
                if done:
                    with self.lock:
                        self.live.pop(rid, None)
                on_output({"text": " word" * len(ids), "output_ids": list(ids), "finished": done,
                           "meta_info": {"id": rid, "finish_reason": {"type": "length",
                                                                     "length": len(ids)}
                                         if done else None,
                                         "prompt_tokens": prompt_len, "completion_tokens": len(ids),
                                         "cached_tokens": 0, "weight_version": "default"}})
                self.offered += 1


def _clients(url: str, streams: int, tokens: int) -> None:
    """The client process: `streams` concurrent streaming requests; prints a JSON summary."""
    import httpx

    async def one(http):
        events = 0
        body = {"input_ids": [1, 2, 3], "stream": True,
                "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
        async with http.stream("POST", url + "/generate", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events += 1
        return events

    async def run():
        async with httpx.AsyncClient(timeout=None,
                                     limits=httpx.Limits(max_connections=streams + 8)) as http:
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(http) for _ in range(streams)))
            return time.perf_counter() - t0, counts

    wall, counts = asyncio.run(run())
    print(json.dumps({"wall_s": wall, "events": sum(counts)}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--profile", default=None)
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop",
                   help="the event loop (uvicorn's default picks uvloop where it is installed)")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the client process's url
    args = p.parse_args()
    if args.client:
        _clients(args.client, args.streams, args.tokens)
        return 0

    import uvicorn

    from jengine.config import LaunchConfig
    from jengine.engine.engine import Engine
    from jengine.server.app import create_app
    from jengine.server.gil import favour_engine_thread
    from jengine.server.testing import free_port

    engine = Engine.from_config(LaunchConfig(model_path="tiny", skip_warmup=True))
    app = create_app(engine)
    producer = _Producer(args.tokens, args.step_ms / 1e3)
    app.state.server.aengine.engine = producer
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    result = {}

    async def drive():
        while not server.started:
            await asyncio.sleep(0.05)
        profiler = cProfile.Profile() if args.profile else None
        cpu0 = time.thread_time()
        if profiler:
            profiler.enable()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", url, "--streams", str(args.streams),
            "--tokens", str(args.tokens), stdout=subprocess.PIPE)
        out, _ = await proc.communicate()
        if profiler:
            profiler.disable()
            profiler.dump_stats(args.profile)
        result.update(json.loads(out), loop_cpu_s=time.thread_time() - cpu0)
        server.should_exit = True

    async def serve():
        favour_engine_thread()
        await asyncio.gather(server.serve(), drive())

    if args.loop == "uvloop":
        import uvloop

        uvloop.run(serve())
    else:
        asyncio.run(serve())
    engine.shutdown()
    events = result["events"]
    print(f"{args.streams} streams x {args.tokens} tokens, a step every {args.step_ms} ms: "
          f"{events / args.streams:.1f} events per request, event loop "
          f"{result['loop_cpu_s'] * 1e6 / events:.1f} µs CPU per event "
          f"({result['loop_cpu_s']:.2f} s), clients' wall {result['wall_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
