"""Request bodies of every POST route, as pydantic models.

Scalars are typed strictly (a string is not a number, 1 is not a bool); unknown top-level keys are
refused (`extra="forbid"`), so a typo such as `return_logprobs` is a 400, not a silently ignored
option. Fields whose JSON shape is a union (a prompt that is a string, a list of strings, a list of
ids or a list of id lists) are typed `Any` here and checked by hand in `inputs.py`, which produces
one clear message instead of pydantic's one-error-per-union-branch.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jengine.server.errors import RequestError, validation_error

Body = TypeVar("Body", bound=BaseModel)


MAX_JSON_DEPTH = 32  # the deepest legitimate body (chat content parts) is about 5


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused (413) as soon as it passes `max_bytes`: by its Content-Length before
    anything is read, else while it streams in -- never read whole and then measured."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(f"request body has {declared} bytes; this server's --max-request-bytes "
                           f"is {max_bytes}", "body", int(declared), status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestError(f"request body has more than {max_bytes} bytes "
                               "(--max-request-bytes)", "body", size, status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def check_json_tree(data: Any) -> None:
    """Refuse what would fail later as a server error: nesting deeper than MAX_JSON_DEPTH and
    strings that are not Unicode text (a lone surrogate such as "\\ud800", which JSON allows and
    UTF-8, the tokenizer and the response encoder do not). Iterative: no recursion to overflow."""
    stack: list[tuple[Any, str, int]] = [(data, "body", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep",
                               path, "(deep)")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise RequestError(f"{path} is not valid Unicode text: {exc.reason} at character "
                                   f"{exc.start}", path, value[:64]) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, f"{path} key", depth + 1))
                stack.append((v, k if path == "body" else f"{path}.{k}", depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The JSON body as `model`, whatever the Content-Type (curl's -d sends a form type), with
    every failure a RequestError naming the field: never a 500 for any input."""
    raw = await read_body(request, request.app.state.server.admission.max_request_bytes)
    try:
        data = json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", "body",
                           raw[:200].decode("utf-8", "replace")) from None
    except RecursionError:
        raise RequestError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep",
                           "body", "(deep)") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object", "body", data)
    check_json_tree(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class GenerateRequest(_Strict):
    """SGLang's native `/generate` body (GenerateReqInput), the fields jengine serves. In a batch,
    return_logprob, logprob_start_len and top_logprobs_num may each be one value or a list with
    one value per prompt, and rid a list of distinct strings or one prefix (`<rid>_<i>`), as in
    SGLang; they are checked by hand in generate_api.py."""

    text: Any = None  # str | list[str]
    input_ids: Any = None  # list[int] | list[list[int]]
    sampling_params: Any = None  # dict | list[dict] (one per batch item)
    return_logprob: Any = False  # bool | list[bool]
    logprob_start_len: Any = -1  # int | list[int]; -1: from the last prompt token (output only)
    top_logprobs_num: Any = 0  # int | list[int]
    return_routed_experts: Any = False  # bool | list[bool]; MoE models (docs/serving.md)
    return_text_in_logprobs: bool = False  # fill the third element of each triple with token text
    rid: Any = None  # str | list[str]
    stream: bool = False


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAIBase(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions.

    Accepted for compatibility but only at their neutral value (checked in openai_api.py):
    presence_penalty, frequency_penalty, logit_bias. `user`, `metadata`, `store`, `service_tier`
    are accepted and ignored: they do not change the numbers.
    """

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # None: 1.0 (OpenAI's default)
    top_p: float | None = None
    n: int = 1
    stop: Any = None  # str | list[str]
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # SGLang/vLLM extensions, reachable from the openai client through `extra_body`.
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool | None = None
    rid: str | None = None


class CompletionRequest(_OpenAIBase):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # number of top alternatives (0: the chosen token only)
    echo: bool = False  # prepend the prompt (and score it when logprobs is set)
    best_of: int | None = None  # only best_of == n is served (no ranking)
    suffix: str | None = None  # not supported: must be null


class ChatCompletionRequest(_OpenAIBase):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None  # only {"type": "text"}
    tools: list[Any] | None = None  # not supported: must be null or empty
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # chat-template switch (vLLM/SGLang extension)


class AbortRequest(_Strict):
    rid: str | None = None
    abort_all: bool = False


# -- the RL loop's admin bodies (rl_api.py): SGLang's io_struct names and fields ------------------
class UpdateWeightFromDiskReqInput(_Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightsFromTensorReqInput(_Strict):
    """serialized_named_tensors: base64 strings, each a safetensors file's bytes; together one
    bucket (SGLang sends one pickled entry per TP rank: jengine never unpickles)."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class ReleaseMemoryOccupationReqInput(_Strict):
    tags: list[str] | None = None  # kv_cache, weights; null: both


class ResumeMemoryOccupationReqInput(_Strict):
    tags: list[str] | None = None


class PauseGenerationReqInput(_Strict):
    mode: str = "abort"  # abort, retract, in_place


class ContinueGenerationReqInput(_Strict):
    pass
