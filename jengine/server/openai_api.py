"""POST /v1/completions and /v1/chat/completions: the OpenAI API, translated onto the engine.

Translation (OpenAI -> engine sampling_params): max_tokens -> max_new_tokens (completions default
16, chat default: the rest of the context), temperature, top_p, stop, seed (honoured: same seed and
request => same output; SGLang ignores it on this route, sglang#15481), and the SGLang/vLLM
extensions top_k, min_p, ignore_eos, stop_token_ids, no_stop_trim (via the client's `extra_body`).
`n` samples n continuations per prompt, each with a distinct seed derived from `seed`.

Logprobs: completions `logprobs=k` returns the chosen token's logprob and the top k
(`echo=true` adds the prompt, its first token scored None: teacher forcing through OpenAI);
chat `logprobs=true, top_logprobs=k` returns `logprobs.content`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import Response

from jengine.server.errors import RequestError
from jengine.server.generate_api import merge_updates
from jengine.server.http_utils import (SSE_DONE, JSONResponse, SSEResponse, sse_event,
                                       unless_disconnected)
from jengine.server.inputs import check_text_lengths, engine_items, prompt_batch
from jengine.server.protocol import (ChatCompletionRequest, CompletionRequest, _OpenAIBase,
                                     parse_body)

router = APIRouter()

MAX_TOP_LOGPROBS = 20  # OpenAI's bound
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's
_EXTENSIONS = ("top_k", "min_p", "ignore_eos", "stop_token_ids", "no_stop_trim")


def _check_request(body: _OpenAIBase, state: Any) -> None:
    if body.model is not None and body.model not in (state.model_name, state.model_path, "default"):
        raise RequestError(f"model {body.model!r} is not served here (served: {state.model_name!r})",
                           "model", body.model, status=404)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise RequestError(f"{name} is not supported (only 0)", name, getattr(body, name))
    if body.logit_bias:
        raise RequestError("logit_bias is not supported", "logit_bias", body.logit_bias)
    if body.n < 1:
        raise RequestError("n must be >= 1", "n", body.n)
    state.admission.check_n(body.n, "n")


def _sampling(body: _OpenAIBase, max_tokens: int | None) -> dict:
    params: dict[str, Any] = {"temperature": 1.0 if body.temperature is None else body.temperature}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    for key in ("top_p", "seed", "stop") + _EXTENSIONS:
        value = getattr(body, key)
        if value is not None:
            params[key] = value
    return params


def _engine_items(state: Any, prompts: list[list[int]], prompt_field: str, params: dict,
                  body: _OpenAIBase, request_id: str, *, max_tokens_name: str, return_logprob: bool,
                  logprob_start_len: int, top_logprobs_num: int, logprobs_name: str,
                  default_max: int | None) -> list[dict]:
    """Every prompt's n samples as engine submissions, all validated before any is submitted;
    choice i*n + j is sample j of prompt i."""
    items = []
    for i, ids in enumerate(prompts):
        base_rid = body.rid or request_id
        if len(prompts) > 1:
            base_rid = f"{base_rid}-{i}"
        names = {"input_ids": f"{prompt_field}[{i}]" if len(prompts) > 1 else prompt_field,
                 "sampling_params.max_new_tokens": max_tokens_name, "sampling_params": "",
                 "top_logprobs_num": logprobs_name, "return_logprob": "logprobs"}
        items += engine_items(state.limits, input_ids=ids, sampling_params={**params, "n": body.n},
                              rid=base_rid, return_logprob=return_logprob,
                              logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                              stream=body.stream, names=names, default_max_new_tokens=(
                                  default_max or state.limits.request.max_context))
    return items


def _usage(prompts: list[list[int]], finals: list[dict]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(out["meta_info"]["completion_tokens"] for out in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish_reason(out: dict) -> str | None:
    if not out.get("finished"):
        return None
    return out["meta_info"]["finish_reason"]["type"]


# -- /v1/completions ------------------------------------------------------------------------------

@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    state = request.app.state.server
    _check_request(body, state)
    if body.suffix is not None:
        raise RequestError("suffix is not supported", "suffix", body.suffix)
    if body.best_of not in (None, body.n):
        raise RequestError("best_of must equal n (no server-side ranking)", "best_of", body.best_of)
    k = body.logprobs
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs", k)
    if body.prompt is None:
        raise RequestError("prompt is required", "prompt", None)
    field, prompts = _completion_prompts(body.prompt)
    state.admission.check_fanout(len(prompts), body.n, "prompt")
    if field == "text":
        check_text_lengths(prompts, state.limits, "prompt", len(prompts) > 1)
    prompt_ids = await state.aengine.encode(prompts) if field == "text" else prompts
    request_id = uuid.uuid4().hex
    items = _engine_items(
        state, prompt_ids, "prompt", _sampling(body, body.max_tokens), body, request_id,
        max_tokens_name="max_tokens", return_logprob=k is not None,
        logprob_start_len=0 if (body.echo and k is not None) else -1, top_logprobs_num=k or 0,
        logprobs_name="logprobs", default_max=16)
    echo_texts = prompts if field == "text" or not body.echo else await state.aengine.run_blocking(
        lambda: [state.engine.tokenizer.decode(ids) for ids in prompt_ids])

    created = int(time.time())
    handles = await state.aengine.submit_all(items)
    head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created,
            "model": state.model_name}
    prompt_of = [i // body.n for i in range(len(handles))]
    if body.stream:
        return SSEResponse(_stream_completion(state, handles, head, body, echo_texts, prompt_of,
                                              prompt_ids))

    finals = await unless_disconnected(asyncio.gather(*(h.final() for h in handles)), request,
                                       lambda: [h.abort() for h in handles])
    choices = []
    for index, out in enumerate(finals):
        echo = echo_texts[prompt_of[index]] if body.echo else ""
        logprobs = await _completion_logprobs(state, out, body, echo) if k is not None else None
        choices.append({"index": index, "text": echo + out["text"], "logprobs": logprobs,
                        "finish_reason": _finish_reason(out)})
    return JSONResponse({**head, "choices": choices, "usage": _usage(prompt_ids, finals)})


def _completion_prompts(prompt: Any) -> tuple[str, list]:
    """OpenAI's prompt: a string, a list of strings, a list of ids or a list of id lists."""
    texts = isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                        and all(isinstance(p, str) for p in prompt))
    try:
        field, prompts, _ = prompt_batch(prompt if texts else None, None if texts else prompt)
    except RequestError as err:
        raise err.renamed({"text": "prompt", "input_ids": "prompt"}) from None
    return field, prompts


async def _completion_logprobs(state: Any, out: dict, body: CompletionRequest, echo: str,
                               new_triples: list | None = None, new_tops: list | None = None,
                               offset: int = 0) -> dict:
    """OpenAI's legacy logprobs object for `new_triples` (default: all of `out`'s, with the
    prompt's in front when echoing)."""
    meta = out["meta_info"]
    if new_triples is None:
        new_triples = list(meta.get("output_token_logprobs") or ())
        new_tops = list(meta.get("output_top_logprobs") or ())
        if echo:
            new_triples = list(meta.get("input_token_logprobs") or ()) + new_triples
            new_tops = list(meta.get("input_top_logprobs") or ()) + new_tops
    ids = [int(t[1]) for t in new_triples]
    tops = new_tops or [None] * len(ids)
    texts = await state.aengine.token_texts(ids + [int(t[1]) for row in tops if row for t in row])
    offsets, pos = [], offset
    for text in texts[:len(ids)]:
        offsets.append(pos)
        pos += len(text)
    top_dicts = None
    if body.logprobs:
        top_iter = iter(texts[len(ids):])
        top_dicts = [{next(top_iter): t[0] for t in row} if row else None for row in tops]
    return {"tokens": texts[:len(ids)], "token_logprobs": [t[0] for t in new_triples],
            "top_logprobs": top_dicts, "text_offset": offsets}


async def _stream_completion(state, handles, head, body, echo_texts, prompt_of,
                             prompt_ids) -> AsyncIterator[bytes]:
    offsets = [0] * len(handles)  # characters already sent per choice (text_offset continues)
    started: set[int] = set()
    async with contextlib.aclosing(merge_updates(handles)) as updates:
        async for index, update in updates:
            text, triples, tops = update.new_text, update.new_logprobs, update.new_top_logprobs
            if body.echo and index not in started:  # the prompt goes out with the first chunk
                meta = update.out["meta_info"]
                text = echo_texts[prompt_of[index]] + text
                triples = list(meta.get("input_token_logprobs") or ()) + triples
                tops = list(meta.get("input_top_logprobs") or ()) + tops
            started.add(index)
            logprobs = None
            if body.logprobs is not None:
                logprobs = await _completion_logprobs(state, update.out, body, "", triples, tops,
                                                      offsets[index])
            offsets[index] += len(text)
            if text or update.new_ids or update.finished:
                yield sse_event({**head, "choices": [{
                    "index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": _finish_reason(update.out)}]})
    if body.stream_options and body.stream_options.include_usage:
        finals = [h.last for h in handles]
        yield sse_event({**head, "choices": [], "usage": _usage(prompt_ids, finals)})
    yield SSE_DONE


# -- /v1/chat/completions -------------------------------------------------------------------------

@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    state = request.app.state.server
    _check_request(body, state)
    if body.tools:
        raise RequestError("tools are not supported", "tools", body.tools)
    if body.response_format not in (None, {"type": "text"}):
        raise RequestError("only response_format {'type': 'text'} is supported", "response_format",
                           body.response_format)
    k = body.top_logprobs
    if k is not None and (not body.logprobs or not 0 <= k <= MAX_TOP_LOGPROBS):
        raise RequestError(f"top_logprobs needs logprobs=true and must be in [0, "
                           f"{MAX_TOP_LOGPROBS}]", "top_logprobs", k)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise RequestError("give max_tokens or max_completion_tokens, not both",
                           "max_completion_tokens", body.max_completion_tokens)
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

    state.admission.check_fanout(1, body.n, "n")
    ids = await _chat_prompt_ids(body, state)
    request_id = uuid.uuid4().hex
    items = _engine_items(state, [ids], "messages", _sampling(body, max_tokens), body, request_id,
                          max_tokens_name=max_name, return_logprob=body.logprobs,
                          logprob_start_len=-1, top_logprobs_num=k or 0,
                          logprobs_name="top_logprobs", default_max=None)
    created = int(time.time())
    handles = await state.aengine.submit_all(items)
    head = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk" if body.stream
            else "chat.completion", "created": created, "model": state.model_name}
    if body.stream:
        return SSEResponse(_stream_chat(state, handles, head, body, ids))

    finals = await unless_disconnected(asyncio.gather(*(h.final() for h in handles)), request,
                                       lambda: [h.abort() for h in handles])
    choices = []
    for index, out in enumerate(finals):
        meta = out["meta_info"]
        logprobs = None
        if body.logprobs:
            logprobs = {"content": await _chat_logprobs(
                state, list(meta.get("output_token_logprobs") or ()),
                list(meta.get("output_top_logprobs") or ()))}
        choices.append({"index": index, "message": {"role": "assistant", "content": out["text"]},
                        "logprobs": logprobs, "finish_reason": _finish_reason(out)})
    return JSONResponse({**head, "choices": choices, "usage": _usage([ids], finals)})


async def _chat_prompt_ids(body: ChatCompletionRequest, state: Any) -> list[int]:
    """Messages -> the model's chat template -> token ids. No template is a 400."""
    if getattr(state.engine.tokenizer, "chat_template", None) is None:
        raise RequestError(f"model {state.model_name!r} has no chat template (tokenizer_config.json "
                           "chat_template); use /v1/completions or /generate", "messages", None)
    if not body.messages:
        raise RequestError("messages must be a non-empty list", "messages", body.messages)
    messages = []
    for i, message in enumerate(body.messages):
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role={role!r} is not one of {', '.join(CHAT_ROLES)}",
                               f"messages[{i}].role", role)
        if isinstance(content, list):  # content parts: only text is served
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise RequestError("only text content parts are supported",
                                   f"messages[{i}].content", content)
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts",
                               f"messages[{i}].content", content)
        messages.append({**message, "content": content})
    for i, m in enumerate(messages):
        check_text_lengths([m["content"]], state.limits, f"messages[{i}].content", False)
    try:
        text = await state.aengine.chat_prompt(messages, body.add_generation_prompt)
    except ValueError as exc:  # the template's own errors (raise_exception, bad structure)
        raise RequestError(f"chat template: {exc}", "messages", None) from None
    return (await state.aengine.encode([text], add_special_tokens=False))[0]


async def _chat_logprobs(state: Any, triples: list, tops: list) -> list[dict]:
    """OpenAI chat logprobs: per token {token, logprob, bytes, top_logprobs: [...]}."""
    ids = [int(t[1]) for t in triples]
    tops = tops or [[]] * len(ids)
    texts = await state.aengine.token_texts(ids + [int(t[1]) for row in tops for t in (row or ())])
    top_iter = iter(texts[len(ids):])

    def entry(text: str, logprob: Any) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for triple, text, row in zip(triples, texts, tops):
        content.append({**entry(text, triple[0]),
                        "top_logprobs": [entry(next(top_iter), t[0]) for t in (row or ())]})
    return content


async def _stream_chat(state, handles, head, body, prompt_ids) -> AsyncIterator[bytes]:
    for index in range(len(handles)):  # OpenAI sends the role first, once per choice
        yield sse_event({**head, "choices": [{"index": index, "delta": {"role": "assistant",
                         "content": ""}, "logprobs": None, "finish_reason": None}]})
    async with contextlib.aclosing(merge_updates(handles)) as updates:
        async for index, update in updates:
            if not (update.new_text or update.new_ids or update.finished):
                continue
            logprobs = None
            if body.logprobs:
                logprobs = {"content": await _chat_logprobs(state, update.new_logprobs,
                                                            update.new_top_logprobs)}
            delta = {"content": update.new_text} if update.new_text else {}
            yield sse_event({**head, "choices": [{"index": index, "delta": delta,
                                                  "logprobs": logprobs,
                                                  "finish_reason": _finish_reason(update.out)}]})
    if body.stream_options and body.stream_options.include_usage:
        yield sse_event({**head, "choices": [], "usage": _usage([prompt_ids],
                                                                [h.last for h in handles])})
    yield SSE_DONE
