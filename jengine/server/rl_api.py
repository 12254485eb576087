"""The RL loop's routes: weight updates, weight versions, pause / continue, memory release.

SGLang's endpoints, bodies (protocol.py: its io_struct names) and `{"success", "message"}`
responses; the engine does the work between steps (docs/engine.md, "Weight updates, memory
release, pause"). A refusal -- another model's checkpoint, a bad tag, memory still held by
requests in flight -- is a 400 with `success: false`, the message and, as every 400 of this
server, the field and value (errors.py). The old weights keep serving after any refusal.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Callable

from fastapi import APIRouter, Request
from starlette.responses import Response

from jengine.engine.rl_control import EngineStateError
from jengine.engine.request import InvalidRequest
from jengine.server.errors import error_response
from jengine.server.http_utils import JSONResponse
from jengine.server.protocol import (ContinueGenerationReqInput, PauseGenerationReqInput,
                                     ReleaseMemoryOccupationReqInput,
                                     ResumeMemoryOccupationReqInput, UpdateWeightFromDiskReqInput,
                                     UpdateWeightsFromTensorReqInput, parse_body)

router = APIRouter()


async def _run(request: Request, fn: Callable, *args: Any, **kwargs: Any) -> Response:
    """Run an engine command off the event loop; refusals become SGLang-shaped 400s."""
    aengine = request.app.state.server.aengine
    try:
        result = await aengine.run_control(fn, *args, **kwargs)
    except InvalidRequest as exc:
        return _refused(str(exc), exc.field, exc.value)
    except EngineStateError as exc:
        return _refused(str(exc), None, None)
    return JSONResponse(result)


def _refused(message: str, field: str | None, value: Any) -> Response:
    # SGLang clients read success/message; this server's clients read error (errors.py).
    return error_response(message, field, value, extra={"success": False, "message": message})


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    body = await parse_body(request, UpdateWeightFromDiskReqInput)
    engine = request.app.state.server.engine
    return await _run(request, engine.update_weights_from_disk, body.model_path,
                      load_format=body.load_format, abort_all_requests=body.abort_all_requests,
                      weight_version=body.weight_version, flush_cache=body.flush_cache)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> Response:
    body = await parse_body(request, UpdateWeightsFromTensorReqInput)
    blobs = []
    for i, text in enumerate(body.serialized_named_tensors):
        try:
            blobs.append(base64.b64decode(text, validate=True))
        except (binascii.Error, ValueError):
            return _refused(f"serialized_named_tensors[{i}] is not base64",
                            f"serialized_named_tensors[{i}]", text[:40])
    engine = request.app.state.server.engine
    return await _run(request, engine.update_weights_from_safetensors, blobs,
                      load_format=body.load_format, abort_all_requests=body.abort_all_requests,
                      weight_version=body.weight_version, flush_cache=body.flush_cache)


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> Response:
    return JSONResponse({"weight_version": request.app.state.server.engine.get_weight_version()})


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    body = await parse_body(request, PauseGenerationReqInput)
    return await _run(request, request.app.state.server.engine.pause_generation, body.mode)


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    await parse_body(request, ContinueGenerationReqInput)
    return await _run(request, request.app.state.server.engine.continue_generation)


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request) -> Response:
    body = await parse_body(request, ReleaseMemoryOccupationReqInput)
    return await _run(request, request.app.state.server.engine.release_memory_occupation, body.tags)


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request) -> Response:
    body = await parse_body(request, ResumeMemoryOccupationReqInput)
    return await _run(request, request.app.state.server.engine.resume_memory_occupation, body.tags)
