"""What streaming costs the serving process's event loop per token, over real HTTP, on the CPU.

    python scripts/stream_http_bench.py [--streams 256] [--tokens 256] [--step-ms 20] [--profile F]

The server's gap to the in-process Engine is the event loop's CPU per streamed token, which holds
the GIL the engine thread needs (docs/performance.md, eleventh session). This measures that path
alone: the real app (`create_app` over the embedded tiny model's Engine) under uvicorn on
127.0.0.1, with the engine's `submit` swapped for a stand-in whose thread offers every request
one new token per `--step-ms` as the output processor does (`build_output`'s dict shape, the
text growing with the ids), and `--streams` streaming `/generate` clients in separate processes
(`--client-procs`; jengine/bench/clients.py, the bench's own) reading the SSE events. Printed:
the event loop thread's CPU µs per event it sent, events per request (fewer than tokens when
readers fall behind), and the clients' wall time. `--profile F`
writes a cProfile of the event loop thread (pstats format) for `python -m pstats F`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--profile", default=None)
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="the event loop (uvloop: where it is installed, as uvicorn's default "
                        "picks it; not a jengine dependency)")
    p.add_argument("--client-procs", type=int, default=1,
                   help="processes the clients run in (jengine/bench/clients.py)")
    args = p.parse_args()

    import uvicorn

    from jengine.bench.clients import run_clients
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
        prompts = [[1, 2, 3]] * args.streams
        sampling = {"max_new_tokens": args.tokens, "ignore_eos": True}
        wall, results, _ = await asyncio.get_running_loop().run_in_executor(
            None, run_clients, url, prompts, sampling, True, args.client_procs)
        if profiler:
            profiler.disable()
            profiler.dump_stats(args.profile)
        result.update(wall_s=wall, events=sum(len(events) for _, events, _ in results),
                      loop_cpu_s=time.thread_time() - cpu0)
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
