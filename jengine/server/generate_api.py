"""POST /generate: SGLang's native dialect, the one RL frameworks (slime, miles, verl) speak.

Request: `text` or `input_ids`, single or batch; `sampling_params` (one object, or one per batch
item); `return_logprob`, `logprob_start_len`, `top_logprobs_num`, `return_routed_experts` (in a
batch: one value, or a list with one per prompt, as SGLang's GenerateReqInput); `return_text_in_logprobs`; `rid` (in a batch: a
list of distinct strings, or one string used as the prefix `<rid>_<i>`); `stream`.
`sampling_params.n > 1` samples n continuations per prompt, each with its own seed. The request's
size is bounded before it is expanded or tokenized (admission.py).

Response: the engine's output dict (`text`, `output_ids`, `meta_info` with `id`, `finish_reason`,
`prompt_tokens`, `completion_tokens`, `cached_tokens` and, with return_logprob, the logprob
triples `[logprob, token_id, null]`; with return_routed_experts, the final output's
`routed_experts`), or a list of them for a batch (n outputs per prompt, prompt
by prompt). Streaming sends `data: {...}` events, each holding the output so far (SGLang's
default, non-incremental stream; a batch adds `index`), then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import Response

from jengine.engine.request import SamplingParams, is_int
from jengine.server.async_engine import RequestStream, Update
from jengine.server.errors import RequestError
from jengine.server.http_utils import (SSE_DONE, CumulativeEvents, JSONResponse, SSEResponse,
                                       unless_disconnected)
from jengine.server.inputs import check_text_lengths, engine_items, per_item, prompt_batch
from jengine.server.protocol import GenerateRequest, parse_body

router = APIRouter()

_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")
_TOP_KEYS = ("input_top_logprobs", "output_top_logprobs")


@router.post("/generate")
async def generate(request: Request) -> Response:
    body = await parse_body(request, GenerateRequest)
    state = request.app.state.server
    items, is_list = await _build_items(body, state)
    handles = await state.aengine.submit_all(items)
    if body.stream:
        return SSEResponse(_stream(handles, is_list, body, state))

    finals = await unless_disconnected(asyncio.gather(*(h.final() for h in handles)), request,
                                       lambda: [h.abort() for h in handles])
    outs = [await _present(out, body, state) for out in finals]
    return JSONResponse(outs if is_list else outs[0])


async def _build_items(body: GenerateRequest, state: Any) -> tuple[list[dict], bool]:
    """The request as engine submissions, every input checked before any is admitted, and its
    size bounded before anything is expanded or tokenized."""
    field, prompts, is_batch = prompt_batch(body.text, body.input_ids)
    count = len(prompts)
    params = per_item(body.sampling_params, count, "sampling_params", is_batch)
    # The field each value came from: `name[i]` where the client sent one value per prompt.
    sent_as = {name: f"{name}[{{}}]" if is_batch and isinstance(getattr(body, name), list) else name
               for name in ("sampling_params",) + _PER_ITEM_OPTIONS}
    ns = [_n(p, sent_as["sampling_params"].format(i), state.admission) for i, p in enumerate(params)]
    state.admission.check_fanout(count, max(ns), "text" if field == "text" else "input_ids")
    options = {name: per_item(getattr(body, name), count, name, is_batch) for name in _PER_ITEM_OPTIONS}
    rids = _rids(body.rid, count, is_batch)
    if field == "text":
        check_text_lengths(prompts, state.limits, field, is_batch)
        ids_list = await state.aengine.encode(prompts)
    else:
        ids_list = prompts

    items: list[dict] = []
    for i, ids in enumerate(ids_list):
        names = {name: sent.format(i) for name, sent in sent_as.items()}
        names["input_ids"] = f"{field}[{i}]" if is_batch else field
        items += engine_items(state.limits, input_ids=ids, sampling_params=params[i],
                              rid=uuid.uuid4().hex if rids[i] is None else rids[i], stream=body.stream,
                              default_max_new_tokens=SamplingParams.max_new_tokens, names=names,
                              **{name: values[i] for name, values in options.items()})
    return items, is_batch or max(ns) > 1


def _n(params: Any, field: str, admission: Any) -> int:
    """sampling_params.n, bounded by --max-n before anything is expanded. A malformed n counts
    as 1 here; the engine's validation refuses it, naming the field."""
    n = params.get("n", 1) if isinstance(params, dict) else 1
    if not is_int(n) or n < 1:
        return 1
    admission.check_n(n, field + ".n")
    return n


_PER_ITEM_OPTIONS = ("return_logprob", "logprob_start_len", "top_logprobs_num",
                     "return_routed_experts")


def _rids(rid: Any, n: int, is_batch: bool) -> list[str | None]:
    if rid is None:
        return [None] * n
    if not is_batch:
        return [rid]  # the engine checks it
    if isinstance(rid, str) and rid:  # SGLang: a string is the prefix of per-item ids
        return [f"{rid}_{i}" for i in range(n)]
    if (not isinstance(rid, list) or len(rid) != n
            or not all(isinstance(r, str) and r for r in rid) or len(set(rid)) != n):
        raise RequestError(f"a batch of {n} needs rid as one string (a prefix) or a list of {n} "
                           "distinct strings", "rid", rid)
    return list(rid)


async def _present(out: dict, body: GenerateRequest, state: Any, index: int | None = None) -> dict:
    """The engine's output as the response body (token text in the triples when asked)."""
    if body.return_text_in_logprobs:  # only items with return_logprob carry logprob keys
        meta = dict(out["meta_info"])
        for key in _LOGPROB_KEYS:
            if meta.get(key):
                meta[key] = await _with_text(meta[key], state)
        for key in _TOP_KEYS:
            if meta.get(key):
                meta[key] = [await _with_text(row, state) if row else row for row in meta[key]]
        out = {**out, "meta_info": meta}
    return out if index is None else {**out, "index": index}


async def _with_text(triples: list, state: Any) -> list:
    texts = await state.aengine.token_texts([int(t[1]) for t in triples])
    return [(t[0], t[1], text) for t, text in zip(triples, texts)]


async def _stream(handles: list[RequestStream], is_list: bool, body: GenerateRequest,
                  state: Any) -> AsyncIterator[bytes]:
    if not is_list and not body.return_text_in_logprobs:
        # The common case, one event per token per request on the event loop: one generator
        # less, no per-event coroutine, and each token id encoded once.
        events = CumulativeEvents()
        async with contextlib.aclosing(handles[0].updates()) as updates:
            async for update in updates:
                yield events.event(update.out)
    else:
        events_of = [CumulativeEvents() for _ in handles]
        async with contextlib.aclosing(merge_updates(handles)) as merged:
            async for index, update in merged:
                out = await _present(update.out, body, state, index if is_list else None)
                yield events_of[index].event(out)
    yield SSE_DONE


async def merge_updates(handles: list[RequestStream]) -> AsyncIterator[tuple[int, Update]]:
    """Interleave several requests' updates as they arrive, tagged with their batch index.
    Closing this generator early aborts every request that has not finished."""
    if len(handles) == 1:
        async with contextlib.aclosing(handles[0].updates()) as updates:
            async for update in updates:
                yield 0, update
        return

    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestStream) -> None:
        try:
            async with contextlib.aclosing(handle.updates()) as updates:
                async for update in updates:
                    queue.put_nowait((index, update))
        except Exception as exc:  # surfaced by the consumer below, not lost in a task
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(tasks)
        while remaining:
            index, update = await queue.get()
            if isinstance(update, Exception):
                raise update
            if update is None:
                remaining -= 1
            else:
                yield index, update
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
