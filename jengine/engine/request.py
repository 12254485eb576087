"""Requests as the engine sees them: validated sampling parameters and the per-request state `Req`.

Everything a request needs to be suspended and resumed lives here on the host: its token list, its
KV frontier (`num_computed`) and its seed. The only device-resident state of a request is its KV
pages, which is why a retraction image is just those pages' bytes plus this object (docs/engine.md,
"Retraction image"). What is only reported (text, logprobs) lives in the output processor's
`RequestState` (output_processor.py), off the engine thread.
"""

from __future__ import annotations

import enum
import math
import zlib
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

_UINT32_MAX = 2**32 - 1


def is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, (float, np.floating))) and math.isfinite(float(value))


_MAX_SHOWN_CHARS = 200  # a 100k-token prompt is not repeated whole in an error message


class InvalidRequest(ValueError):
    """A request the engine refuses: the field (a path such as `input_ids[3]` or
    `sampling_params.top_p`), its value, and why.

    Raised only while a request is validated, before anything is queued. Callers read the three
    parts, never the message: the HTTP server names the field its client sent
    (`sampling_params.max_new_tokens` -> `max_tokens`) with `renamed`. The message is
    "<field><shown> <reason>": `shown` is `=<value>` unless the caller gives a summary
    (" has 200 tokens;"), and `reason` reads on from it ("must be in (0, 1]").
    """

    def __init__(self, field: str, value: Any, reason: str, *, shown: str | None = None) -> None:
        self.field, self.value, self.reason = field, value, reason
        if shown is None:
            text = repr(value)
            shown = "=" + (text if len(text) <= _MAX_SHOWN_CHARS
                           else text[:_MAX_SHOWN_CHARS] + "...(truncated)")
        self.shown = shown
        super().__init__(f"{field}{shown} {reason}")

    def renamed(self, field: str) -> "InvalidRequest":
        return InvalidRequest(field, self.value, self.reason, shown=self.shown)


def _bad(name: str, value: Any, why: str) -> InvalidRequest:
    return InvalidRequest(f"sampling_params.{name}", value, why)


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling_params dict, validated once. Unknown keys are refused, never ignored."""

    max_new_tokens: int | None = 128  # None: up to the context length
    temperature: float = 1.0  # 0 = greedy (canonical lowest-index argmax)
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    seed: int | None = None  # None: crc32(rid)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False  # keep a matched stop string in the returned text
    n: int = 1

    def __post_init__(self) -> None:
        # Normalise the list-ish fields first (frozen: go through object.__setattr__).
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop", self.stop, "must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "must be a list of non-negative ints")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))

        if self.max_new_tokens is not None and (not is_int(self.max_new_tokens) or self.max_new_tokens < 0):
            raise _bad("max_new_tokens", self.max_new_tokens, "must be an int >= 0 or null")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if not is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise _bad("top_k", self.top_k, "must be -1 (off) or an int >= 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= _UINT32_MAX):
            raise _bad("seed", self.seed, f"must be an int in [0, {_UINT32_MAX}] or null")
        for name in ("ignore_eos", "no_stop_trim"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise _bad(name, getattr(self, name), "must be a bool")
        if not is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "must be an int >= 1")

    @classmethod
    def from_dict(cls, params: "SamplingParams | dict[str, Any] | None") -> "SamplingParams":
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise InvalidRequest("sampling_params", params, "must be a dict")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known, key=str)
        if unknown:
            raise _bad(unknown[0], params[unknown[0]],
                       f"is not a sampling parameter: unknown key(s) {unknown}; known keys: "
                       f"{sorted(known)}")
        return cls(**params)

    def with_seed(self, seed: int, n: int = 1) -> "SamplingParams":
        return SamplingParams(**{**self.to_dict(), "seed": seed, "n": n})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def default_seed(rid: str) -> int:
    """A request without an explicit seed draws from crc32(rid): stable across runs and batches."""
    return zlib.crc32(rid.encode("utf-8")) & _UINT32_MAX


def derive_sample_seeds(base_seed: int, n: int) -> list[int]:
    """Seeds of the n samples of one prompt: distinct by construction, fixed by the base seed."""
    seeds = [zlib.crc32(f"{base_seed}/{i}".encode()) & _UINT32_MAX for i in range(n)]
    # crc32 of distinct short strings can collide in principle; perturb deterministically if so.
    seen: set[int] = set()
    for i, s in enumerate(seeds):
        while s in seen:
            s = (s + 0x9E3779B9) & _UINT32_MAX
        seeds[i] = s
        seen.add(s)
    return seeds


def sample_rids_and_seeds(rid: str, seed: int | None, n: int) -> list[tuple[str, int]]:
    """(rid, seed) of each of the n samples of one prompt: the only place they are derived (the
    engine and the HTTP server both call it). n == 1 keeps the rid; n > 1 names the samples
    `<rid>-<i>` and gives each a distinct seed derived from the request's seed (or, without one,
    from crc32 of its rid): the samples differ, and the same request reproduces them."""
    base = seed if seed is not None else default_seed(rid)
    if n == 1:
        return [(rid, base)]
    return [(f"{rid}-{i}", s) for i, s in enumerate(derive_sample_seeds(base, n))]


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # never admitted
    RUNNING = "running"  # holds pages, scheduled every step it fits the budget
    RETRACTED = "retracted"  # pages freed; its image waits at the front of the queue
    FINISHED = "finished"


@dataclass
class RetractionImage:
    """A suspended request's device state, copied out byte for byte (spec: "Retraction is a byte copy").

    `kv` holds the bytes of the pages covering the first `num_computed` tokens, the partial last page
    included. The scheduler creates the image when it retracts; the bytes arrive when the runner
    executes the step's `PageSave` (jengine/engine/batch.py), before any later restore reads them.
    The slot state (next input token = fill_ids[num_computed], its position = num_computed, the
    sampler's (seed, position) key) is derived from the host-side `Req`, which is kept as is.
    """

    num_pages: int
    num_computed: int
    kv: Any = None  # the runner's read_pages array; None until the save has run

    @property
    def saved(self) -> bool:
        """Whether the bytes it needs are on the host (an image of no pages needs none)."""
        return self.num_pages == 0 or self.kv is not None


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1  # resolved: L-1 when the caller passed -1
    top_logprobs_num: int = 0
    return_routed_experts: bool = False  # export each forwarded row's expert ids (MoE models)
    stream: bool = False

    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    pages: list[int] = field(default_factory=list)  # page table, position order; page 0 never
    num_computed: int = 0  # KV frontier: tokens whose K/V are written in `pages`
    cached_tokens: int = 0  # prefix-cache hit length at admission
    admit_seq: int = -1  # admission order (retraction victims: latest admitted first)
    image: RetractionImage | None = None
    retractions: int = 0
    # False once the weights changed under this request (an update while generation was paused):
    # its KV then mixes two weight versions and is never offered to the prefix cache.
    kv_reusable: bool = True
    # The overlap schedule: its pages are already released because its last output, still being
    # sampled, ends it whatever it is; it takes no more rows and finishes when that token is known.
    sealed: bool = False

    # Set by the engine thread when a token-level stop condition (or an abort) ends the request.
    # Text, stop strings and logprob lists live in the output processor's RequestState.
    finish_reason: dict[str, Any] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def fill_ids(self) -> list[int]:
        """Every token the request has: prompt, then outputs. KV exists for fill_ids[:num_computed]."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to be fed to the model: the prompt remainder, or the last sampled token."""
        return self.num_tokens - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def scored_rows(self, start: int, end: int) -> range:
        """Prompt positions p in [start, end) whose hidden row scores target prompt_ids[p + 1].

        Rows logprob_start_len .. L-2 are scored; row L-1 predicts the first output token instead.
        """
        if not self.return_logprob:
            return range(0)
        return range(max(start, self.logprob_start_len), min(end, self.prompt_len - 1))

    def append_token(self, token: int, *, eos_token_ids: frozenset[int], max_context: int) -> None:
        """Record a sampled token, then apply the token-level stop conditions in SGLang's order:
        eos (unless ignore_eos), stop_token_ids, max_new_tokens, context length. Stop strings need
        the text, so the output processor checks them off the engine thread (output_processor.py)."""
        self.output_ids.append(token)
        self.check_stop(token, eos_token_ids=eos_token_ids, max_context=max_context)

    def resolve_token(self, token: int, *, eos_token_ids: frozenset[int], max_context: int) -> None:
        """The overlap schedule: the last output, appended as a placeholder when its step was
        dispatched, is now known; the stop conditions apply as `append_token`'s would have."""
        if not self.output_ids or self.output_ids[-1] >= 0:
            raise RuntimeError(f"request {self.rid}: no placeholder to resolve (outputs end "
                               f"{self.output_ids[-1:]})")
        self.output_ids[-1] = token
        self.check_stop(token, eos_token_ids=eos_token_ids, max_context=max_context)

    def ends_whatever_token(self, max_context: int) -> bool:
        """Whether the request ends at its last output whatever that token is: max_new_tokens or
        the context length reached (what the overlap schedule knows before the token)."""
        return (len(self.output_ids) >= self.sampling.max_new_tokens
                or self.num_tokens >= max_context)

    def check_stop(self, token: int, *, eos_token_ids: frozenset[int], max_context: int) -> None:
        sp = self.sampling
        if (not sp.ignore_eos and token in eos_token_ids) or token in sp.stop_token_ids:
            self.finish("stop", matched=token)  # the stop token's text is not part of `text`
        elif len(self.output_ids) >= sp.max_new_tokens or self.num_tokens >= max_context:
            self.finish("length")

    def finish(self, reason: str, matched: Any = None, message: str | None = None) -> None:
        info: dict[str, Any] = {"type": reason}
        if matched is not None:
            info["matched"] = matched
        if message is not None:
            info["message"] = message
        self.finish_reason = info
        self.status = ReqStatus.FINISHED
