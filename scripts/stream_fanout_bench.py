"""What handing one engine step's outputs to N streaming requests costs the host, on the CPU.

    python scripts/stream_fanout_bench.py [--streams 256] [--steps 200]

The server's engine thread calls `RequestStream.offer` once per request per step
(jengine/server/async_engine.py); the event loop then wakes each stream's reader. This drives
that path alone, with no model and no HTTP: an AsyncEngine over a stand-in engine, N streams read
by N tasks on the event loop (each taking its update as a route does), and a thread offering
every stream a new cumulative output per step, then waiting until every reader has it. Printed:
the offering thread's CPU µs per step, and the wall ms per step from the first offer to the last
reader woken. Both share the GIL with the event loop in the server, which is why they matter
there (docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jengine.server.async_engine import AsyncEngine  # noqa: E402


class _Engine:
    """What AsyncEngine reads from an engine, and a submit that keeps the output callback."""

    class plan:  # noqa: N801 -- attribute access as on the real plan
        class scheduler:  # noqa: N801
            max_running_requests = 100_000

    class config:  # noqa: N801
        dp_size = 1

    tokenizer = None

    def __init__(self):
        self.callbacks = []

    def submit(self, *, on_output, **_):
        self.callbacks.append(on_output)


async def _run(streams: int, steps: int) -> tuple[list[float], list[float]]:
    engine = _Engine()
    ae = AsyncEngine(engine)
    handles = await ae.submit_all([dict(input_ids=[1], sampling_params={}) for _ in range(streams)],
                                  admit=False)
    seen = [0] * streams
    all_seen = asyncio.Event()
    target = [0]
    count = [0]

    async def reader(i, handle):
        async for update in handle.updates():
            seen[i] = len(update.out["output_ids"])
            if seen[i] == target[0]:
                count[0] += 1
                if count[0] == streams:
                    all_seen.set()

    tasks = [asyncio.create_task(reader(i, h)) for i, h in enumerate(handles)]
    loop = asyncio.get_running_loop()
    cpu_us, wall_ms = [], []
    for step in range(1, steps + 1):
        target[0], count[0] = step, 0
        all_seen.clear()
        finished = step == steps
        outs = [{"text": "x" * step, "output_ids": list(range(step)), "meta_info": {},
                 "finished": finished} for _ in range(streams)]
        t_wall = time.perf_counter()

        def offer_all():
            t0 = time.thread_time()
            for cb, out in zip(engine.callbacks, outs):
                cb(out)
            cpu_us.append((time.thread_time() - t0) * 1e6)

        await loop.run_in_executor(None, offer_all)
        await all_seen.wait()
        wall_ms.append((time.perf_counter() - t_wall) * 1e3)
    await asyncio.gather(*tasks)
    ae.close()
    return cpu_us, wall_ms


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    cpu_us, wall_ms = asyncio.run(_run(args.streams, args.steps))
    print(f"{args.streams} streams, {args.steps} steps: offering thread "
          f"{statistics.median(cpu_us):.0f} µs CPU per step (median), "
          f"{statistics.median(wall_ms):.2f} ms from first offer to every reader woken")
    return 0


if __name__ == "__main__":
    sys.exit(main())
