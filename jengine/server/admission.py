"""Bounded admission: how much one HTTP request may ask for, and how much work may wait.

No single request may take the server down, so every bound is checked *before* the work it bounds
is done:

  --max-request-bytes      the body, before it is read past the bound            -> 413
  --max-n                  samples per prompt, before anything is expanded       -> 400
  --max-batch-requests     engine requests one HTTP request creates (prompts x n),
                           before any prompt is tokenized                        -> 400
  text length              a text that cannot fit the context even at the
                           tokenizer's longest token, before tokenizing          -> 400
  --max-waiting-requests   requests in flight beyond the running set
  --max-queued-tokens      prompt + max_new_tokens of every request in flight    -> 503 + Retry-After
                           (a request that alone exceeds it can never fit        -> 400)

400/413 mean "this request can never be served"; 503 with `Retry-After` means "not now". A batch
is admitted whole or not at all. The bounds are reported by /get_server_info (`server.admission`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jengine.server.errors import RequestError

MiB = 1 << 20


@dataclass(frozen=True)
class AdmissionLimits:
    max_n: int = 64
    max_batch_requests: int = 256
    max_request_bytes: int = 8 * MiB
    max_waiting_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{f.name.replace('_', '-')}={value!r} must be an integer >= 1")

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    # -- checks that need only the request --------------------------------------------------------
    def check_n(self, n: Any, field: str) -> None:
        if isinstance(n, int) and not isinstance(n, bool) and n > self.max_n:
            raise RequestError(f"{field}={n} is above this server's --max-n {self.max_n}", field, n)

    def check_fanout(self, prompts: int, n: int, field: str) -> None:
        """prompts x n engine requests from one HTTP request (before expansion or tokenization)."""
        total = prompts * n
        if total > self.max_batch_requests:
            raise RequestError(
                f"this request creates {total} generations ({prompts} prompt(s) x n={n}); this "
                f"server's --max-batch-requests is {self.max_batch_requests}", field, total)

    def check_body_size(self, size: int) -> None:
        if size > self.max_request_bytes:
            raise RequestError(f"request body has more than {self.max_request_bytes} bytes "
                               "(--max-request-bytes)", "body", size, status=413)


class WorkQueue:
    """What is in flight, in requests and tokens, against the waiting bounds (event-loop only)."""

    def __init__(self, limits: AdmissionLimits, max_running: int):
        self.limits = limits
        self.max_running = max_running
        self.tokens: dict[str, int] = {}  # rid -> prompt + max_new_tokens

    @property
    def queued_tokens(self) -> int:
        return sum(self.tokens.values())

    def reserve(self, items: list[dict]) -> None:
        """Admit every item or none: 400 if the batch can never fit, 503 if it cannot fit now."""
        need = [len(it["input_ids"]) + int(it["sampling_params"].get("max_new_tokens") or 0)
                for it in items]
        total = sum(need)
        lim = self.limits
        if total > lim.max_queued_tokens:
            raise RequestError(f"this request needs {total} tokens of work (prompt + max_new_tokens)"
                               f"; this server's --max-queued-tokens is {lim.max_queued_tokens}",
                               "max_new_tokens", total)
        capacity = self.max_running + lim.max_waiting_requests
        if len(self.tokens) + len(items) > capacity:
            raise self._busy(f"{len(self.tokens)} requests in flight (at most {capacity}: "
                             f"{self.max_running} running + --max-waiting-requests "
                             f"{lim.max_waiting_requests})")
        if self.queued_tokens + total > lim.max_queued_tokens:
            raise self._busy(f"{self.queued_tokens} tokens of work queued (--max-queued-tokens "
                             f"{lim.max_queued_tokens})")
        for it, n in zip(items, need):
            self.tokens[it["rid"]] = n

    def release(self, rid: str) -> None:
        self.tokens.pop(rid, None)

    def _busy(self, why: str) -> RequestError:
        return RequestError(f"server busy: {why}; retry later", None, None, status=503,
                            headers={"Retry-After": str(self.limits.retry_after_s)})
