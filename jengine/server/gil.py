"""The serving process's GIL switch interval: what keeps the engine thread fed while the event
loop streams.

The engine thread gives the GIL up many times a step (every device call and wait) and must win it
back each time. While the event loop holds it -- encoding and sending hundreds of streams --
CPython hands it over only when the holder's switch interval runs out, 5 ms by default: a step
with ten such waits then takes ~50 ms longer (a 3 ms step measured 54 ms against a thread encoding
JSON; 9 ms at 0.5 ms). The loop's own throughput is unchanged: it is switched out no more often
than the engine thread waits for the GIL. The serving process sets it (`jengine serve`, the
bench's server), not the library: an in-process Engine's caller keeps its own setting.

0.1 ms since the eleventh session: on the H200, 256 streaming clients, the engine loop's
schedule + dispatch phases summed over the run fell from 8.5 to 6.5 s and the server's output
from 3428 to 3728 tok/s against 0.5 ms (one run each; docs/performance.md). The switch interval
only bounds how long the engine thread waits for the GIL; what keeps the other threads from
asking for it while the engine thread works is its host gate (jengine/engine/host_gate.py).
"""

from __future__ import annotations

import sys

ENGINE_SWITCH_INTERVAL_S = 0.0001


def favour_engine_thread(interval_s: float = ENGINE_SWITCH_INTERVAL_S) -> None:
    """Set the interpreter's switch interval to `interval_s` seconds (for a process that serves)."""
    if not interval_s > 0:
        raise ValueError(f"switch interval {interval_s!r} s must be > 0")
    sys.setswitchinterval(interval_s)
