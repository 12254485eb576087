"""`jengine serve` / `python -m jengine.serve`: build the Engine, then serve it with uvicorn.

Options are LaunchConfig's (jengine.config.add_launch_arguments), plus the server-only
--graceful-shutdown-timeout and the admission bounds (jengine/server/admission.py: --max-n,
--max-batch-requests, --max-request-bytes, --max-waiting-requests, --max-queued-tokens). With no
options: the embedded `tiny` model on 127.0.0.1:30000.

Shutdown. On SIGINT or SIGTERM the server stops admitting (the listening socket closes, /health
and new requests on open connections answer 503), lets in-flight requests finish for up to
--graceful-shutdown-timeout seconds, aborts whatever is still running (each such request gets its
final output with finish_reason "abort", message "server shutting down"), shuts the engine down
and exits with status 0. A second SIGINT exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

import uvicorn

from jengine.config import add_launch_arguments, launch_config_from_args
from jengine.server.admission import AdmissionLimits
from jengine.server.async_engine import SHUTDOWN_MESSAGE

logger = logging.getLogger("jengine.server")

DESCRIPTION = ("Serve a model over HTTP: SGLang's native /generate and the OpenAI API "
               "(/v1/completions, /v1/chat/completions). Default: the embedded 'tiny' model on "
               "127.0.0.1:30000.")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser)
    parser.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                        help="on SIGINT/SIGTERM, seconds in-flight requests may run before they "
                             "are aborted (default 30)")
    d = AdmissionLimits()
    group = parser.add_argument_group("admission (400/413: can never fit; 503 + Retry-After: not now)")
    group.add_argument("--max-n", type=int, default=d.max_n,
                       help=f"samples per prompt, every route (default {d.max_n})")
    group.add_argument("--max-batch-requests", type=int, default=d.max_batch_requests,
                       help="generations one HTTP request may create, prompts x n "
                            f"(default {d.max_batch_requests})")
    group.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                       help=f"request body size, checked before parsing (default {d.max_request_bytes})")
    group.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                       help="requests in flight beyond the running set "
                            f"(default {d.max_waiting_requests})")
    group.add_argument("--max-queued-tokens", type=int, default=d.max_queued_tokens,
                       help="prompt + max_new_tokens of all requests in flight "
                            f"(default {d.max_queued_tokens})")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="serve the OpenAI and SGLang /generate APIs over HTTP",
                                   description=DESCRIPTION)
    add_serve_arguments(parser)
    return parser


def build_parser(prog: str = "python -m jengine.serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_serve_arguments(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    from jengine.server.app import create_app
    from jengine.server.gil import favour_engine_thread
    from jengine.server.replicas import serving_engine

    config = launch_config_from_args(args)
    level = getattr(logging, str(config.log_level).upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.graceful_shutdown_timeout < 0:
        raise SystemExit(f"--graceful-shutdown-timeout={args.graceful_shutdown_timeout} must be >= 0")
    try:
        admission = AdmissionLimits(max_n=args.max_n, max_batch_requests=args.max_batch_requests,
                                    max_request_bytes=args.max_request_bytes,
                                    max_waiting_requests=args.max_waiting_requests,
                                    max_queued_tokens=args.max_queued_tokens)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None

    # Until uvicorn takes over the signals, SIGTERM (like Ctrl-C) stops the startup cleanly.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        engine = serving_engine(config)  # one Engine, or --dp-size replicas of it
    except KeyboardInterrupt:
        logger.info("interrupted during startup")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        options = engine.plan.server
        app = create_app(engine, extra_info={"graceful_shutdown_timeout": args.graceful_shutdown_timeout},
                         admission=admission)
        server = GracefulServer(
            uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                           timeout_graceful_shutdown=args.graceful_shutdown_timeout + 10.0,
                           access_log=level <= logging.DEBUG),
            app.state.server.aengine, grace_s=args.graceful_shutdown_timeout)
        favour_engine_thread()
        server.run()
    finally:
        engine.shutdown()
    if not server.started:
        logger.error("the server did not start (is %s:%d free?)", options.host, options.port)
        return 1
    logger.info("server stopped")
    return 0


def _interrupt(sig: int, frame: Any) -> None:
    raise KeyboardInterrupt


class GracefulServer(uvicorn.Server):
    """uvicorn.Server with jengine's shutdown: drain, abort after the grace period, exit 0."""

    def __init__(self, config: uvicorn.Config, aengine: Any, grace_s: float):
        super().__init__(config)
        self.aengine = aengine
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)
        if self._drain_task is not None:
            self._drain_task.cancel()

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Runs in the main thread between two bytecodes of the event loop: hand over to the loop.
        if not self.should_exit and self._loop is not None:
            logger.info("%s: no longer admitting; in-flight requests get %.0f s to finish",
                        signal.Signals(sig).name, self.grace_s)
            self._loop.call_soon_threadsafe(self._begin_drain)
        super().handle_exit(sig, frame)  # uvicorn: close the listener, wait for connections

    def _begin_drain(self) -> None:
        self.aengine.draining = True
        self._drain_task = asyncio.ensure_future(self._abort_after_grace())

    async def _abort_after_grace(self) -> None:
        await asyncio.sleep(self.grace_s)
        if self.aengine.num_in_flight:
            logger.info("grace period over: aborting %d request(s)", self.aengine.num_in_flight)
            await self.aengine.abort_all(SHUTDOWN_MESSAGE)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises a captured signal after shutting down, so the process dies of it; a
        # graceful shutdown is a normal exit here, so only install (and later restore) handlers.
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run(argv: list[str] | None = None) -> int:
    return main(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(run())
