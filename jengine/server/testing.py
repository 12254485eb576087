"""Launch a real `python -m jengine.serve` process on loopback and wait until it is healthy.

For tests and harnesses that must talk to the server over HTTP exactly as a client would:

    with ServerProcess(["--max-running-requests", "8"]) as server:
        requests.post(server.url + "/generate", json={...})

The server's output goes to a log file (never a pipe that could fill up and block it); a server
that dies or does not come up in time raises with the tail of that log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str] = (), *, startup_timeout_s: float = 900.0,
                 env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "jengine.serve", "--port", str(self.port), *args]
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="jengine-server-", suffix=".log",
                                               delete=False)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.startup_timeout_s:.0f} s:\n"
                           f"{self.log_tail()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (graceful shutdown), then SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def log_tail(self, chars: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]


def check_cumulative_stream(events: list[dict], n_tokens: int) -> None:
    """A /generate stream's events (the parsed `data:` payloads before [DONE]) as documented: each
    holds the output so far -- a prefix of the final one, longer than the event before (a reader
    that fell behind gets several new tokens in one event) -- and only the last is finished."""
    final = events[-1]["output_ids"]
    lengths = [len(e["output_ids"]) for e in events]
    assert len(final) == n_tokens and lengths == sorted(set(lengths)) and lengths[0] > 0, lengths
    assert all(e["output_ids"] == final[:len(e["output_ids"])] for e in events), events
    assert [e["finished"] for e in events] == [False] * (len(events) - 1) + [True], events
