"""JSON and Server-Sent-Events encoding, client-disconnect handling, and the API-key gate.

Logprobs are float32 values widened to Python floats; `json.dumps` writes the shortest repr that
round-trips the double, so a client that casts back to float32 gets the engine's exact bits (-0.0
included). A logprob of -inf is written as `-Infinity` (Python's json reads it back; strict JSON
parsers do not) rather than silently turned into null.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np
from fastapi import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"

logger = logging.getLogger(__name__)


def jsonable(obj: Any) -> Any:
    """Engine values -> JSON values: tuples and arrays become lists, numpy scalars Python ones."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(jsonable(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


# One encoder for every response, built once: json.dumps builds a JSONEncoder per call, and even a
# kept JSONEncoder builds its C encoder on every encode() (~1.5 µs, more than a small stream
# event's own encoding). Everything json writes natively (the engine's dicts, lists, tuples, ints,
# floats, strings) stays in the C encoder -- a cumulative stream event is encoded per token per
# request, so walking it in Python first (`jsonable`) cost the event loop more than the encoding
# itself. Floats are written by float.__repr__ either way, so the bytes are those `jsonable` +
# json.dumps wrote, for every value whose dict keys are strings or ints (all of ours; other keys
# take the `jsonable` path below). `jsonable` is also json's hook for what it cannot write itself
# (numpy values, sets, dataclasses). No circular-reference bookkeeping (markers=None): it would be
# shared by every thread that encodes, and an engine output holds no cycles.
def _make_encoder(ensure_ascii: bool) -> Callable[[Any], str]:
    string = json.encoder.encode_basestring_ascii if ensure_ascii else json.encoder.encode_basestring
    if json.encoder.c_make_encoder is None:  # a Python without json's C accelerator
        return json.JSONEncoder(ensure_ascii=ensure_ascii, allow_nan=True, separators=(",", ":"),
                                default=jsonable).encode
    chunks = json.encoder.c_make_encoder(None, jsonable, string, None, ":", ",", False, False, True)
    return lambda obj: string(obj) if type(obj) is str else "".join(chunks(obj, 0))


_ENCODE = _make_encoder(ensure_ascii=False)
_ENCODE_ASCII = _make_encoder(ensure_ascii=True)


def _encode(encode: Callable[[Any], str], obj: Any) -> str:
    try:
        return encode(obj)
    except TypeError:  # a dict key json cannot write (jsonable str()s it)
        return encode(jsonable(obj))


def dumps(obj: Any) -> str:
    return _encode(_ENCODE, obj)


def dumps_bytes(obj: Any) -> bytes:
    """UTF-8 JSON; a string holding a lone surrogate (which UTF-8 cannot encode, e.g. an echoed
    bad input) is written \\u-escaped instead of failing the response."""
    try:
        return dumps(obj).encode("utf-8")
    except UnicodeEncodeError:
        return _encode(_ENCODE_ASCII, obj).encode("ascii")


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps_bytes(content)


def sse_event(obj: Any) -> bytes:
    return b"data: " + dumps_bytes(obj) + b"\n\n"


class CumulativeEvents:
    """`sse_event(out)` for the successive outputs of one cumulative stream (/generate's: each
    output holds the whole `output_ids` so far), byte for byte, with each token id encoded once
    instead of once per event: re-encoding the whole list cost the event loop 16 µs of an event's
    ~60 at 128 tokens, 29 µs at 256 (scripts/stream_http_bench.py). An output that is not the
    previous one extended (other keys first, ids rewritten) takes the plain path and starts over."""

    def __init__(self) -> None:
        self._ids: list | None = None  # the previous output's output_ids (a copy)
        self._encoded = ""  # their JSON, without the brackets

    def event(self, out: Any) -> bytes:
        ids = out.get("output_ids") if type(out) is dict else None
        keys = iter(out) if type(ids) is list else iter(())
        if next(keys, None) != "text" or next(keys, None) != "output_ids":
            self._ids = None
            return sse_event(out)
        done = self._ids
        if done is None or len(ids) < len(done) or ids[:len(done)] != done:
            done, self._encoded = [], ""
        if len(ids) > len(done):
            new = _encode(_ENCODE, ids[len(done):])[1:-1]
            self._encoded = f"{self._encoded},{new}" if self._encoded else new
        self._ids = ids[:]  # a copy: a caller may extend its list in place
        rest = {k: v for k, v in out.items() if k != "text" and k != "output_ids"}
        tail = _encode(_ENCODE, rest)
        body = (f'{{"text":{_encode(_ENCODE, out["text"])},"output_ids":[{self._encoded}]'
                + ("}" if tail == "{}" else "," + tail[1:]))
        try:
            return b"data: " + body.encode("utf-8") + b"\n\n"
        except UnicodeEncodeError:  # a lone surrogate: dumps_bytes' escaped form
            return sse_event(out)


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its generator, so a generator's `finally`
    (which aborts the engine request) runs whether the stream ends, fails or the client leaves.
    A failure after the stream has started cannot become an HTTP status any more: the client gets
    an `error` event and `[DONE]` instead of a silently truncated stream."""

    def __init__(self, content: AsyncIterator[bytes], **kw: Any):
        super().__init__(_guarded(content), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


async def _guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event
    except Exception as exc:
        logger.exception("stream failed")
        yield sse_event({"error": {"message": f"internal server error: {type(exc).__name__}: {exc}",
                                   "type": "server_error", "field": None, "value": None,
                                   "code": 500}})
        yield SSE_DONE
    finally:
        await events.aclose()  # type: ignore[attr-defined]


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) response was ready."""


async def unless_disconnected(work: Awaitable, request: Request, on_disconnect: Callable[[], None],
                              poll_s: float = 0.25) -> Any:
    """Await `work`; if the client disconnects first, call `on_disconnect` (abort) and raise."""
    task = asyncio.ensure_future(work)
    # A cancelled gather stores its children's CancelledError as its own exception; retrieve it so
    # asyncio does not log "exception was never retrieved" with a traceback on every disconnect.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                on_disconnect()
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


class ApiKeyMiddleware:
    """With --api-key, every HTTP route except /health needs `Authorization: Bearer <key>`."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        body = {"error": {"message": "missing or invalid API key: send 'Authorization: Bearer <key>'",
                          "type": "authentication_error", "field": "Authorization",
                          "value": None, "code": 401}}
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class RequestCounter:
    """Counts HTTP responses by route template and status (pure ASGI: streaming stays untouched)."""

    def __init__(self, app: ASGIApp, counter: Any):
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", "other")
            self.counter.labels(route=route, status=str(status["code"])).inc()
