"""What crosses the API boundary: argument normalisation and validation on the way in, the
SGLang-shaped output dict on the way out, and the handle a caller waits on (SGLang's io_struct).

Validation runs in the caller's thread, before anything is queued, so bad input raises a ValueError
naming the field and the value and the engine never sees it.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from jengine.engine.request import Req, SamplingParams, default_seed, derive_sample_seeds, is_int

if TYPE_CHECKING:  # output_processor imports this module
    from jengine.engine.output_processor import RequestState


def _pairs(values: list[float], token_ids: list[int]) -> list[tuple[float, int, None]]:
    return [(float(v), int(t), None) for v, t in zip(values, token_ids)]


def _top_lists(tops: list[tuple[np.ndarray, np.ndarray]]) -> list[list[tuple[float, int, None]]]:
    return [_pairs(list(vals), list(ids)) for vals, ids in tops]


def visible_text(req: "RequestState") -> str:
    """Text safe to show before the request finishes: a tail that could still grow into a stop
    string is held back, so a streamed prefix is never retracted by a later trim."""
    if req.finished or not req.sampling.stop:
        return req.text
    hold = 0
    for stop in req.sampling.stop:
        for k in range(min(len(stop) - 1, len(req.text)), hold, -1):
            if req.text.endswith(stop[:k]):
                hold = k
                break
    return req.text[: len(req.text) - hold]


def build_output(req: "RequestState") -> dict[str, Any]:
    """The SGLang-shaped output dict (cumulative, also for streamed partial outputs). Built in the
    output processor's thread, never inside an engine step."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": req.prompt_len,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
    }
    if req.return_logprob:
        s = req.logprob_start_len
        # Position s is context, not a target (spec, "Input and output vocabularies"): its entry
        # carries None, as SGLang's does; positions s+1.. carry the scored targets' logprobs.
        scored = req.input_token_logprobs
        meta["input_token_logprobs"] = ([(None, req.prompt_ids[s], None)]
                                        + _pairs(scored, req.prompt_ids[s + 1: s + 1 + len(scored)]))
        meta["output_token_logprobs"] = _pairs(req.output_token_logprobs, req.output_ids)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [None] + _top_lists(req.input_top_logprobs)
            meta["output_top_logprobs"] = _top_lists(req.output_top_logprobs)
    return {
        "text": visible_text(req),
        "output_ids": list(req.output_ids),
        "finished": req.finished,
        "meta_info": meta,
    }


# ------------------------------------------------------------------------------------------------
# Admission-time validation and the handle a caller waits on
# ------------------------------------------------------------------------------------------------
class RequestHandle:
    """What `Engine.submit` returns. result() -> the final output dict (a list for n > 1)."""

    def __init__(self, rid: str, rids: list[str], single: bool) -> None:
        self.rid = rid
        self.rids = rids
        self._single = single
        self._outputs: dict[str, dict] = {}
        self._event = threading.Event()

    def _set(self, rid: str, out: dict) -> None:
        self._outputs[rid] = out
        if len(self._outputs) == len(self.rids):
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> dict | list[dict]:
        if not self._event.wait(timeout):
            raise TimeoutError(f"request {self.rid!r} did not finish within {timeout} s")
        outs = [self._outputs[r] for r in self.rids]
        return outs[0] if self._single else outs


def _as_token_list(ids: Any, name: str) -> list[int]:
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    for i, t in enumerate(ids):
        if not is_int(t):
            raise ValueError(f"{name}[{i}]={t!r} is not an int token id")
    return [int(t) for t in ids]


def normalize_generate_args(tokenizer: Any, prompt: Any, input_ids: Any, sampling_params: Any,
                            return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any,
                            rid: Any) -> tuple[list[dict[str, Any]], bool]:
    """`generate`'s single-or-list arguments -> one dict per prompt, and whether a list came in."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompt= or input_ids=")
    if prompt is not None:
        batched = isinstance(prompt, (list, tuple))
        texts = list(prompt) if batched else [prompt]
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"prompt[{i}]={text!r} is not a string")
        ids_list = [tokenizer.encode(text) for text in texts]
    else:
        if isinstance(input_ids, np.ndarray):
            input_ids = input_ids.tolist()
        batched = isinstance(input_ids, (list, tuple)) and len(input_ids) > 0 and isinstance(
            input_ids[0], (list, tuple, np.ndarray))
        ids_list = list(input_ids) if batched else [input_ids]
    count = len(ids_list)

    def per_item(value: Any, name: str, i: int) -> Any:
        if isinstance(value, list):
            if not batched or len(value) != count:
                raise ValueError(f"{name} is a list of {len(value)} but {count} prompt(s) were given")
            return value[i]
        if name == "rid" and batched and value is not None:
            raise ValueError(f"rid={value!r}: a batch needs a list of rids (or none)")
        return value

    items = [dict(input_ids=ids, sampling_params=per_item(sampling_params, "sampling_params", i),
                  return_logprob=per_item(return_logprob, "return_logprob", i),
                  logprob_start_len=per_item(logprob_start_len, "logprob_start_len", i),
                  top_logprobs_num=per_item(top_logprobs_num, "top_logprobs_num", i),
                  rid=per_item(rid, "rid", i))
             for i, ids in enumerate(ids_list)]
    return items, batched


def expand_request(*, input_ids: Any, sampling_params: Any, return_logprob: Any, logprob_start_len: Any,
                   top_logprobs_num: Any, rid: str, max_context: int, input_vocab_size: int,
                   vocab_size: int, pool_tokens: int, page_size: int) -> list[Req]:
    """Validate one request against the loaded model and the pool; n > 1 becomes n requests
    "<rid>-i" with distinct derived seeds. Every error names the field and the value."""
    sp = SamplingParams.from_dict(sampling_params)
    ids = _as_token_list(input_ids, "input_ids")
    n_tok = len(ids)
    if n_tok == 0:
        raise ValueError("input_ids is empty: a request needs at least one prompt token")
    if n_tok >= max_context:
        raise ValueError(f"input_ids has {n_tok} tokens; the context length is {max_context} "
                         f"(the prompt must leave room for one more token)")
    pool_need = -(-n_tok // page_size) * page_size
    if pool_need > pool_tokens:
        raise ValueError(f"input_ids has {n_tok} tokens but the KV pool holds {pool_tokens} "
                         f"(--max-total-tokens)")
    for i, t in enumerate(ids):
        if not 0 <= t < input_vocab_size:
            raise ValueError(f"input_ids[{i}]={t} is out of range [0, input_vocab_size={input_vocab_size})")
    if sp.max_new_tokens is None:
        sp = dataclasses.replace(sp, max_new_tokens=max_context - n_tok)
    if sp.max_new_tokens > max_context:
        raise ValueError(f"sampling_params.max_new_tokens={sp.max_new_tokens} exceeds the context "
                         f"length {max_context}")
    for i, t in enumerate(sp.stop_token_ids):
        if t >= vocab_size:
            raise ValueError(f"sampling_params.stop_token_ids[{i}]={t} >= vocab_size={vocab_size}")
    if not isinstance(return_logprob, (bool, np.bool_)):
        raise ValueError(f"return_logprob={return_logprob!r} must be a bool")
    if not is_int(logprob_start_len) or not -1 <= logprob_start_len < n_tok:
        raise ValueError(f"logprob_start_len={logprob_start_len!r} must be -1 or in [0, {n_tok}) "
                         f"(the prompt has {n_tok} tokens)")
    if not is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= vocab_size:
        raise ValueError(f"top_logprobs_num={top_logprobs_num!r} must be an int in [0, {vocab_size}]")
    start = n_tok - 1 if logprob_start_len == -1 else int(logprob_start_len)
    if return_logprob:
        # Scored targets are input_ids[start + 1:]; they must be OUTPUT tokens (spec, "Input and
        # output vocabularies"). The token at `start` is context only and keeps the input bound.
        for i in range(start + 1, n_tok):
            if ids[i] >= vocab_size:
                raise ValueError(f"input_ids[{i}]={ids[i]} is a prompt-logprob target but is out of "
                                 f"the output vocabulary [0, vocab_size={vocab_size})")
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"rid={rid!r} must be a non-empty string")

    base_seed = sp.seed if sp.seed is not None else default_seed(rid)
    if sp.n == 1:
        variants = [(rid, base_seed)]
    else:
        variants = [(f"{rid}-{i}", s) for i, s in enumerate(derive_sample_seeds(base_seed, sp.n))]
    return [Req(rid=r, prompt_ids=list(ids), sampling=sp, seed=seed, return_logprob=bool(return_logprob),
                logprob_start_len=start, top_logprobs_num=int(top_logprobs_num) if return_logprob else 0)
            for r, seed in variants]
