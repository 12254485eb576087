"""HTTP request inputs as engine submissions.

What is HTTP's own is checked here: the body's shape (`text` | `input_ids`, single or batch, one
value or one per item), the length of a text before it is tokenized, and the routes'
max_new_tokens. Everything else is the engine's `validate_request`, called for every item of a
batch before any is admitted; its `InvalidRequest` becomes a 400 naming the field the client sent
(`input_ids[3]`, `max_tokens`) and its value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jengine.engine.io_struct import RequestLimits, validate_request
from jengine.engine.request import InvalidRequest, Req
from jengine.server.errors import RequestError


@dataclass(frozen=True)
class ModelLimits:
    request: RequestLimits  # the engine's (engine.request_limits)
    # A text longer than this many characters cannot fit the context however it tokenizes: it is
    # refused before tokenizing (admission.py). None: the tokenizer gives no bound.
    max_text_chars: int | None = None


# Margin on the bound above: a normalizer may merge characters (NFC) before tokenizing.
TEXT_BOUND_MARGIN = 4


def longest_token_chars(tokenizer: Any) -> int | None:
    """Characters of the tokenizer's longest vocabulary entry (byte-level BPE writes one character
    per byte, so a token covers at most that many characters of text)."""
    backend = getattr(tokenizer, "backend", None)  # jengine's Tokenizer: the tokenizers.Tokenizer
    if not hasattr(backend, "get_vocab"):
        return None
    return max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=None)


def model_limits(engine: Any) -> ModelLimits:
    request = engine.request_limits
    longest = longest_token_chars(engine.tokenizer)
    bound = None if longest is None else request.max_context * longest * TEXT_BOUND_MARGIN
    return ModelLimits(request, bound)


def check_text_lengths(texts: list[str], limits: ModelLimits, field: str, is_batch: bool) -> None:
    """Refuse, before tokenizing, a text that cannot fit the context (tokenizing a 20 MB prompt
    took 25 s of a tokenizer thread only to be refused)."""
    if limits.max_text_chars is None:
        return
    for i, text in enumerate(texts):
        if len(text) > limits.max_text_chars:
            name = f"{field}[{i}]" if is_batch else field
            raise RequestError(f"{name} has {len(text)} characters: more than any tokenization of it "
                               f"fits in the context length {limits.request.max_context}", name,
                               f"({len(text)} characters)")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def prompt_batch(text: Any, input_ids: Any) -> tuple[str, list, bool]:
    """(field, prompts, is_batch) from SGLang's `text` | `input_ids`; shapes checked here."""
    if (text is None) == (input_ids is None):
        raise RequestError("exactly one of 'text' and 'input_ids' must be given", "text",
                           None if text is None else "(both given)")
    if text is not None:
        if isinstance(text, str):
            return "text", [text], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return "text", list(text), True
        raise RequestError("text must be a string or a non-empty list of strings", "text", text)
    if isinstance(input_ids, list) and input_ids and all(_is_int(t) for t in input_ids):
        return "input_ids", [list(input_ids)], False
    if (isinstance(input_ids, list) and input_ids
            and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in input_ids)):
        return "input_ids", [list(p) for p in input_ids], True
    raise RequestError("input_ids must be a non-empty list of ints or a list of lists of ints",
                       "input_ids", input_ids)


def per_item(value: Any, n: int, field: str, is_batch: bool) -> list[Any]:
    """A batch field may be one value for all items or a list with one value per item."""
    if is_batch and isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{field} has {len(value)} entries for a batch of {n}", field, value)
        return list(value)
    return [value] * n


def fit_max_new_tokens(params: dict, req: Req, limits: ModelLimits, default: int) -> int:
    """The routes' max_new_tokens, for a request the engine has validated. The engine finishes a
    request at the context length; over HTTP an explicit value that cannot fit is refused instead
    (OpenAI's max_tokens), and a missing one is the route's default shortened to what fits."""
    room = limits.request.max_context - req.prompt_len
    given = params.get("max_new_tokens")
    if given is not None and given > room:
        raise InvalidRequest("sampling_params.max_new_tokens", given, "does not fit: the prompt "
                             f"has {req.prompt_len} tokens and the context length is "
                             f"{limits.request.max_context} (at most {room} new tokens)")
    if "max_new_tokens" not in params:
        return min(default, room)
    return req.sampling.max_new_tokens  # given, or null: the engine's "up to the context"


def engine_items(limits: ModelLimits, *, input_ids: list[int], sampling_params: Any, rid: str,
                 return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any, stream: bool,
                 default_max_new_tokens: int, names: dict[str, str],
                 return_routed_experts: Any = False) -> list[dict]:
    """One prompt as engine submissions, one per sample (n > 1: the engine's own rids and seeds),
    validated by the engine's `validate_request`. Its refusal becomes a 400 naming the field the
    client sent: `names` maps engine field paths to the route's (see `RequestError.from_invalid`)."""
    params = {} if sampling_params is None else sampling_params
    if isinstance(params, dict) and "max_new_tokens" not in params:
        params = {**params, "max_new_tokens": None}  # validated as "up to the context", then fitted
    try:
        reqs = validate_request(limits.request, input_ids=input_ids, sampling_params=params,
                                return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                top_logprobs_num=top_logprobs_num, rid=rid,
                                return_routed_experts=return_routed_experts)
        max_new_tokens = fit_max_new_tokens(sampling_params or {}, reqs[0], limits,
                                            default_max_new_tokens)
    except InvalidRequest as exc:
        raise RequestError.from_invalid(exc, names) from None
    return [dict(input_ids=input_ids, rid=req.rid, stream=stream, return_logprob=return_logprob,
                 logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                 sampling_params={**req.sampling.to_dict(), "max_new_tokens": max_new_tokens,
                                  "seed": req.seed, "n": 1},
                 # only when asked: an engine without MoE layers never sees the keyword
                 **({"return_routed_experts": True} if req.return_routed_experts else {}))
            for req in reqs]
