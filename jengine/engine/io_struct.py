"""What crosses the API boundary: argument normalisation and validation on the way in, the
SGLang-shaped output dict on the way out, and the handle a caller waits on (SGLang's io_struct).

Validation (`validate_request`) runs in the caller's thread, before anything is queued, so bad input
raises an `InvalidRequest` (a ValueError) naming the field and the value and the engine never sees it.
"""

from __future__ import annotations

import base64
import dataclasses
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jengine.engine.request import InvalidRequest, Req, SamplingParams, is_int, sample_rids_and_seeds

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
        "weight_version": req.weight_version,
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
    if req.return_routed_experts and req.finished:  # the final output only (also when streamed)
        meta["routed_experts"] = encode_routed_experts(req.routed_rows())
    return {
        "text": visible_text(req),
        "output_ids": list(req.output_ids),
        "finished": req.finished,
        "meta_info": meta,
    }


def encode_routed_experts(ids: np.ndarray) -> str:
    """SGLang's `meta_info["routed_experts"]`: the int32[positions, layers, k] ids, row-major, as
    little-endian int32 bytes in base64 (no shape: the reader knows the model's layers and k)."""
    return base64.b64encode(np.ascontiguousarray(ids, "<i4").tobytes()).decode("ascii")


def decode_routed_experts(value: str, num_layers: int, top_k: int) -> np.ndarray:
    """`encode_routed_experts`'s inverse: int32[positions, num_layers, top_k]."""
    return np.frombuffer(base64.b64decode(value), "<i4").astype(np.int32).reshape(
        -1, num_layers, top_k)


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


@dataclass(frozen=True)
class RequestLimits:
    """What a request is validated against: the loaded model and the KV pool."""

    max_context: int  # prompt + output tokens of one request
    input_vocab_size: int  # prompt token ids are below this
    vocab_size: int  # the output vocabulary: sampled ids, logprob targets, stop_token_ids
    pool_tokens: int  # the KV pool (--max-total-tokens), a whole number of pages
    page_size: int
    architecture: str = ""  # named by refusals
    routes_experts: bool = False  # the model has MoE layers: return_routed_experts is served


def _as_token_list(ids: Any, name: str) -> list[int]:
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequest(name, ids, f"must be a list of token ids, not {type(ids).__name__}")
    for i, t in enumerate(ids):
        if not is_int(t):
            raise InvalidRequest(f"{name}[{i}]", t, "is not an int token id")
    return [int(t) for t in ids]


def normalize_generate_args(tokenizer: Any, prompt: Any, input_ids: Any, sampling_params: Any,
                            return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any,
                            rid: Any, return_routed_experts: Any = False
                            ) -> tuple[list[dict[str, Any]], bool]:
    """`generate`'s single-or-list arguments -> one dict per prompt, and whether a list came in."""
    if (prompt is None) == (input_ids is None):
        raise InvalidRequest("prompt", prompt, "and input_ids: pass exactly one of prompt= or input_ids=",
                             shown="")
    if prompt is not None:
        batched = isinstance(prompt, (list, tuple))
        texts = list(prompt) if batched else [prompt]
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidRequest(f"prompt[{i}]", text, "is not a string")
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
                raise InvalidRequest(name, value, f"is a list of {len(value)} but {count} prompt(s) "
                                     "were given", shown="")
            return value[i]
        if name == "rid" and batched and value is not None:
            raise InvalidRequest("rid", value, "is one string, but a batch needs a list of rids (or none)")
        return value

    items = [dict(input_ids=ids, sampling_params=per_item(sampling_params, "sampling_params", i),
                  return_logprob=per_item(return_logprob, "return_logprob", i),
                  logprob_start_len=per_item(logprob_start_len, "logprob_start_len", i),
                  top_logprobs_num=per_item(top_logprobs_num, "top_logprobs_num", i),
                  return_routed_experts=per_item(return_routed_experts, "return_routed_experts", i),
                  rid=per_item(rid, "rid", i))
             for i, ids in enumerate(ids_list)]
    return items, batched


def validate_request(limits: RequestLimits, *, input_ids: Any, sampling_params: Any,
                     return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any,
                     rid: Any, return_routed_experts: Any = False) -> list[Req]:
    """The one place a request is validated (the engine's `submit` and `generate`, and the HTTP
    server before it admits a batch, all call it). n > 1 becomes n requests (see
    `sample_rids_and_seeds`). Every refusal is an `InvalidRequest` naming the field and value."""
    sp = SamplingParams.from_dict(sampling_params)
    ids = _as_token_list(input_ids, "input_ids")
    n_tok, max_context = len(ids), limits.max_context
    if n_tok == 0:
        raise InvalidRequest("input_ids", ids, "a request needs at least one prompt token",
                             shown=" is empty:")
    if n_tok >= max_context:
        raise InvalidRequest("input_ids", n_tok, f"the context length is {max_context} (the prompt "
                             "must leave room for one more token)", shown=f" has {n_tok} tokens;")
    pool_need = -(-n_tok // limits.page_size) * limits.page_size
    if pool_need > limits.pool_tokens:
        raise InvalidRequest("input_ids", n_tok, f"but the KV pool holds {limits.pool_tokens} "
                             "(--max-total-tokens)", shown=f" has {n_tok} tokens")
    for i, t in enumerate(ids):
        if not 0 <= t < limits.input_vocab_size:
            raise InvalidRequest(f"input_ids[{i}]", t, "is out of range "
                                 f"[0, input_vocab_size={limits.input_vocab_size})")
    if sp.max_new_tokens is None:
        sp = dataclasses.replace(sp, max_new_tokens=max_context - n_tok)
    if sp.max_new_tokens > max_context:
        raise InvalidRequest("sampling_params.max_new_tokens", sp.max_new_tokens,
                             f"exceeds the context length {max_context}")
    vocab_size = limits.vocab_size
    for i, t in enumerate(sp.stop_token_ids):
        if t >= vocab_size:
            raise InvalidRequest(f"sampling_params.stop_token_ids[{i}]", t,
                                 f"is not in the output vocabulary [0, vocab_size={vocab_size})")
    if not isinstance(return_logprob, (bool, np.bool_)):
        raise InvalidRequest("return_logprob", return_logprob, "must be a bool")
    if not is_int(logprob_start_len) or not -1 <= logprob_start_len < n_tok:
        raise InvalidRequest("logprob_start_len", logprob_start_len, f"must be -1 or in [0, {n_tok}) "
                             f"(the prompt has {n_tok} tokens)")
    if not is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= vocab_size:
        raise InvalidRequest("top_logprobs_num", top_logprobs_num, f"must be an int in [0, {vocab_size}]")
    if not isinstance(return_routed_experts, (bool, np.bool_)):
        raise InvalidRequest("return_routed_experts", return_routed_experts, "must be a bool")
    if return_routed_experts and not limits.routes_experts:
        raise InvalidRequest("return_routed_experts", True, f"the model "
                             f"({limits.architecture or 'this one'}) has no MoE layers: no token is "
                             "routed to experts")
    start = n_tok - 1 if logprob_start_len == -1 else int(logprob_start_len)
    if return_logprob:
        # Scored targets are input_ids[start + 1:]; they must be OUTPUT tokens (spec, "Input and
        # output vocabularies"). The token at `start` is context only and keeps the input bound.
        for i in range(start + 1, n_tok):
            if ids[i] >= vocab_size:
                raise InvalidRequest(f"input_ids[{i}]", ids[i], "is a prompt-logprob target but is "
                                     f"out of the output vocabulary [0, vocab_size={vocab_size})")
    if not isinstance(rid, str) or not rid:
        raise InvalidRequest("rid", rid, "must be a non-empty string")
    try:
        rid.encode("utf-8")  # the default seed is crc32 of these bytes
    except UnicodeEncodeError as exc:
        raise InvalidRequest("rid", rid, f"is not valid Unicode text: {exc.reason}") from None

    return [Req(rid=r, prompt_ids=list(ids), sampling=sp, seed=seed, return_logprob=bool(return_logprob),
                logprob_start_len=start, top_logprobs_num=int(top_logprobs_num) if return_logprob else 0,
                return_routed_experts=bool(return_routed_experts))
            for r, seed in sample_rids_and_seeds(rid, sp.seed, sp.n)]
