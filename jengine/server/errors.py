"""HTTP error bodies: every bad request becomes a 400 that names the field and the value.

Body shape (OpenAI-compatible, plus `field` and `value`):
    {"error": {"message": ..., "type": "invalid_request_error", "field": ..., "value": ..., "code": 400}}

The `openai` client reads `error.message`; SGLang-dialect clients read the status code. Pydantic's
422 is remapped to 400 here so every client sees one convention.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError

from jengine.engine.request import InvalidRequest
from jengine.server.http_utils import JSONResponse

_MAX_VALUE_CHARS = 200  # a 100k-token prompt must not be echoed back whole


class RequestError(Exception):
    """A client mistake: becomes an HTTP error naming `field` and `value`."""

    def __init__(self, message: str, field: str | None = None, value: Any = None, status: int = 400,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.value = value
        self.status = status
        self.headers = headers

    def renamed(self, names: dict[str, str]) -> "RequestError":
        """The same error with engine field names replaced by the route's (max_new_tokens -> max_tokens)."""
        if self.field is None:
            return self
        head, sep, tail = self.field.partition("[")
        new_field = names.get(head, head) + sep + tail
        message = self.message.replace(self.field, new_field) if new_field != self.field else self.message
        return RequestError(message, new_field, self.value, self.status, self.headers)

    @classmethod
    def from_invalid(cls, exc: InvalidRequest, names: dict[str, str] | None = None) -> "RequestError":
        """The engine's refusal as a 400 naming the field the client sent. `names` maps an engine
        field path's head to the route's: {"input_ids": "text[2]"} makes `input_ids[5]` read
        `text[2][5]`; {"sampling_params.max_new_tokens": "max_tokens", "sampling_params": ""}
        makes `sampling_params.top_p` read `top_p`. The longest matching head wins."""
        field = exc.field
        for head in sorted(names or {}, key=len, reverse=True):
            rest = field[len(head):]
            if field.startswith(head) and rest[:1] in ("", ".", "["):
                new = names[head]
                field = new + rest if new else rest.lstrip(".")
                break
        return cls(str(exc.renamed(field)), field, exc.value)


def _json_safe(value: Any) -> Any:
    """Echo the offending value if it is small JSON; otherwise a truncated repr."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = None
    if text is not None and len(text) <= _MAX_VALUE_CHARS:
        return value
    shown = repr(value)
    return shown if len(shown) <= _MAX_VALUE_CHARS else shown[:_MAX_VALUE_CHARS] + "...(truncated)"


def error_response(message: str, field: str | None = None, value: Any = None,
                   status: int = 400, kind: str | None = None,
                   headers: dict[str, str] | None = None, extra: dict | None = None) -> JSONResponse:
    """extra: top-level keys beside "error" (the RL routes add SGLang's success and message)."""
    kind = kind or {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error", 413: "request_too_large",
                    503: "service_unavailable"}.get(status, "server_error")
    body = {"error": {"message": message, "type": kind, "field": field, "value": _json_safe(value),
                      "code": status}, **(extra or {})}
    return JSONResponse(body, status_code=status, headers=headers)


def validation_error(errors: list[dict]) -> RequestError:
    """Pydantic's first error -> a RequestError naming the dotted field and the offending value."""
    if not errors:
        return RequestError("invalid request body", "body", None)
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    field = re.sub(r"\.(\d+)", r"[\1]", ".".join(loc)) if loc else "body"
    if err.get("type") == "extra_forbidden":
        return RequestError(f"unknown field {field!r}", field, err.get("input"))
    return RequestError(f"{field}: {err.get('msg', 'invalid value')}", field, err.get("input"))


async def handle_request_error(request: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc.message, exc.field, exc.value, exc.status, headers=exc.headers)


async def handle_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = validation_error(list(exc.errors()))
    return error_response(err.message, err.field, err.value, 400)
