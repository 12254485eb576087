"""Request inputs checked against the model before anything reaches the engine.

The engine validates too (its ValueError becomes a 400 as well); these checks exist so every error
names the HTTP field the client sent (`input_ids[3]`, `max_tokens`) and its value, and so a batch
is refused as a whole before any item of it is admitted.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from jengine.engine.request import SamplingParams, default_seed, derive_sample_seeds
from jengine.server.errors import RequestError

SAMPLING_KEYS = tuple(SamplingParams.__dataclass_fields__)


@dataclass(frozen=True)
class ModelLimits:
    context_length: int  # max tokens of prompt + output of one request (engine.max_context)
    input_vocab_size: int  # prompt token ids must be below this
    vocab_size: int  # output vocabulary: sampled ids, logprob targets, stop_token_ids
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
    mc = engine.model_config
    longest = longest_token_chars(engine.tokenizer)
    bound = None if longest is None else int(engine.max_context) * longest * TEXT_BOUND_MARGIN
    return ModelLimits(int(engine.max_context), int(mc.input_vocab_size), int(mc.vocab_size), bound)


def check_text_lengths(texts: list[str], limits: ModelLimits, field: str, is_batch: bool) -> None:
    """Refuse, before tokenizing, a text that cannot fit the context (tokenizing a 20 MB prompt
    took 25 s of a tokenizer thread only to be refused)."""
    if limits.max_text_chars is None:
        return
    for i, text in enumerate(texts):
        if len(text) > limits.max_text_chars:
            name = f"{field}[{i}]" if is_batch else field
            raise RequestError(f"{name} has {len(text)} characters: more than any tokenization of it "
                               f"fits in the context length {limits.context_length}", name,
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


def check_prompt(ids: list[int], limits: ModelLimits, field: str) -> None:
    if not ids:
        raise RequestError(f"{field} is empty: a prompt needs at least one token", field, ids)
    for i, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t < limits.input_vocab_size:
            raise RequestError(f"{field}[{i}]={t!r} is not a token id in [0, {limits.input_vocab_size})"
                               " (the model's input vocabulary)", f"{field}[{i}]", t)
    if len(ids) >= limits.context_length:  # the engine's rule: leave room for one more token
        raise RequestError(f"{field} has {len(ids)} tokens; the context length is "
                           f"{limits.context_length} (a prompt must be shorter)", field, len(ids))


def check_logprob_options(ids: list[int], limits: ModelLimits, field: str, *, return_logprob: bool,
                          logprob_start_len: int, top_logprobs_num: int) -> None:
    """Prompt logprobs score targets ids[max(start, 1):]; each must be an output-vocabulary id."""
    if not -1 <= logprob_start_len < max(len(ids), 1):
        raise RequestError(f"logprob_start_len={logprob_start_len} must be -1 (output logprobs "
                           f"only) or a prompt position in [0, {len(ids)})",
                           "logprob_start_len", logprob_start_len)
    if not 0 <= top_logprobs_num <= limits.vocab_size:
        raise RequestError(f"top_logprobs_num={top_logprobs_num} must be in [0, {limits.vocab_size}]",
                           "top_logprobs_num", top_logprobs_num)
    if return_logprob and logprob_start_len >= 0:
        for i in range(max(logprob_start_len, 1), len(ids)):
            if ids[i] >= limits.vocab_size:
                raise RequestError(
                    f"{field}[{i}]={ids[i]} is scored as a prompt-logprob target but is not in the "
                    f"output vocabulary [0, {limits.vocab_size})", f"{field}[{i}]", ids[i])


def sampling_params(params: Any, prompt_len: int, limits: ModelLimits, field: str,
                    default_max_new_tokens: int = 128) -> dict:
    """Validate one sampling_params dict (by the engine's own SamplingParams rules) and fit
    max_new_tokens to the context: an explicit value that does not fit is an error, the default
    is shortened to what fits. Errors name `<field>.<key>`, or just `<key>` when field is ""."""
    prefix = f"{field}." if field else ""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RequestError(f"{field} must be an object", field, params)
    for key in params:
        if key not in SAMPLING_KEYS:
            raise RequestError(f"{prefix}{key} is not a sampling parameter (known: "
                               f"{', '.join(SAMPLING_KEYS)})", prefix + key, params[key])
    try:
        SamplingParams.from_dict(params)
    except ValueError as exc:  # the engine's message: "sampling_params.<key>=<value>: why"
        match = re.match(r"sampling_params\.(\w+)=", str(exc))
        key = match.group(1) if match else None
        raise RequestError(str(exc).replace("sampling_params.", prefix, 1),
                           prefix + key if key else field, params.get(key, params)) from None
    room = limits.context_length - prompt_len
    out = dict(params)
    if "max_new_tokens" in params and params["max_new_tokens"] is None:
        out["max_new_tokens"] = room  # null: up to the context length (the engine's meaning)
    elif "max_new_tokens" in params:
        if params["max_new_tokens"] > room:
            raise RequestError(
                f"{prefix}max_new_tokens={params['max_new_tokens']} does not fit: the prompt has "
                f"{prompt_len} tokens and the context length is {limits.context_length} "
                f"(at most {room} new tokens)", prefix + "max_new_tokens", params["max_new_tokens"])
    else:
        out["max_new_tokens"] = min(default_max_new_tokens, room)
    for i, t in enumerate(out.get("stop_token_ids") or ()):
        if t >= limits.vocab_size:
            raise RequestError(f"{prefix}stop_token_ids[{i}]={t} is not in the output vocabulary "
                               f"[0, {limits.vocab_size})", f"{prefix}stop_token_ids[{i}]", t)
    return out


def sample_rids_and_seeds(rid: str | None, seed: int | None,
                          n: int) -> list[tuple[str | None, int | None]]:
    """(rid, seed) of each of n samples of one prompt. n == 1 keeps the request as sent. For n > 1
    each sample gets its own rid (`<rid>-<j>`) and a distinct seed derived, as the engine does,
    from the request's seed (or, without one, from crc32 of its rid): the n samples differ, and
    the same request reproduces them."""
    if n == 1:
        return [(rid, seed)]
    rid = rid or uuid.uuid4().hex
    base = seed if seed is not None else default_seed(rid)
    return [(f"{rid}-{j}", s) for j, s in enumerate(derive_sample_seeds(base, n))]
