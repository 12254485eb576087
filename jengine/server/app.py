"""The FastAPI application: `create_app(engine)` wires the routes around one running Engine.

Routes (docs/serving.md has a curl example for each):
    POST /generate                      SGLang native dialect (generate_api.py)
    POST /v1/completions, /v1/chat/completions, GET /v1/models      OpenAI (openai_api.py)
    GET  /health, /health_generate, /get_model_info, /get_server_info, /metrics
    POST /flush_cache, /abort_request
    POST /update_weights_from_disk, /update_weights_from_tensor, /pause_generation,
         /continue_generation, /release_memory_occupation, /resume_memory_occupation
    GET  /get_weight_version                                         the RL loop (rl_api.py)

Every client mistake is a 400 (413 for an oversized body) whose JSON body names the field and the
value (errors.py); a request that could be served later, but not now, is a 503 with Retry-After
(admission.py); an unexpected failure inside one request is a 500 for that request only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response

from jengine.server import errors
from jengine.server.admission import AdmissionLimits
from jengine.server.async_engine import SHUTDOWN_MESSAGE, AsyncEngine
from jengine.server.errors import RequestError, error_response
from jengine.server.generate_api import router as generate_router
from jengine.server.http_utils import ApiKeyMiddleware, ClientGone, JSONResponse, RequestCounter
from jengine.server.inputs import model_limits
from jengine.server.metrics import CONTENT_TYPE, ServerMetrics
from jengine.server.openai_api import router as openai_router
from jengine.server.protocol import AbortRequest, parse_body
from jengine.server.rl_api import router as rl_router

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 60.0


@dataclasses.dataclass
class ServerState:
    """What every route reaches through `request.app.state.server`."""

    engine: Any
    aengine: AsyncEngine
    metrics: ServerMetrics
    model_name: str  # reported by /v1/models and checked against a request's `model`
    model_path: str
    limits: Any  # inputs.ModelLimits
    admission: AdmissionLimits
    extra_info: dict  # server-only options (e.g. the graceful-shutdown timeout) for /get_server_info
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def create_app(engine: Any, *, api_key: str | None = None, served_model_name: str | None = None,
               extra_info: dict | None = None, admission: AdmissionLimits | None = None) -> FastAPI:
    options = engine.plan.server
    api_key = options.api_key if api_key is None else api_key
    admission = admission or AdmissionLimits()
    metrics = ServerMetrics(engine)
    aengine = AsyncEngine(engine, metrics, admission=admission)
    metrics.in_flight = lambda: aengine.num_in_flight
    state = ServerState(
        engine=engine, aengine=aengine, metrics=metrics,
        model_name=served_model_name or options.served_model_name or engine.config.model_path,
        model_path=engine.config.model_path, limits=model_limits(engine), admission=admission,
        extra_info={**(extra_info or {}), "admission": admission.as_dict()})

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        aengine.draining = True
        await aengine.abort_all(SHUTDOWN_MESSAGE)
        aengine.close()

    app = FastAPI(title="jengine", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    app.add_exception_handler(RequestError, errors.handle_request_error)
    app.add_exception_handler(RequestValidationError, errors.handle_validation_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(generate_router)
    app.include_router(openai_router)
    app.include_router(rl_router)
    _add_admin_routes(app, state)
    app.add_middleware(RequestCounter, counter=state.metrics.http_requests)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


async def _client_gone(request: Request, exc: ClientGone) -> Response:
    logger.info("client left %s before its response; its requests were aborted", request.url.path)
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("internal error serving %s", request.url.path)
    return error_response(f"internal server error: {type(exc).__name__}: {exc}", status=500)


def _add_admin_routes(app: FastAPI, state: ServerState) -> None:
    engine, aengine = state.engine, state.aengine

    @app.get("/health")
    async def health() -> Response:
        if aengine.draining:
            return error_response("server is shutting down", status=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Runs one real token through the engine (the queue, a forward, the sampler)."""
        if aengine.draining:
            return error_response("server is shutting down", status=503)
        handle = await aengine.submit(input_ids=[0], sampling_params={
            "max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}, admit=False)
        try:
            out = await asyncio.wait_for(handle.final(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response(f"no token within {HEALTH_GENERATE_TIMEOUT_S:.0f} s", status=503)
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            return error_response("the health request was aborted", status=503)
        return JSONResponse({"status": "ok", "output_ids": out["output_ids"]})

    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        tokenizer = engine.tokenizer
        return JSONResponse({
            "model_path": state.model_path, "served_model_name": state.model_name,
            "is_generation": True, "context_length": state.limits.request.max_context,
            "input_vocab_size": state.limits.request.input_vocab_size,
            "vocab_size": state.limits.request.vocab_size,
            "has_chat_template": getattr(tokenizer, "chat_template", None) is not None,
            "model_config": engine.model_config})

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        info = dict(await aengine.run_control(engine.server_info))
        if info.get("api_key"):
            info["api_key"] = "<redacted>"  # a secret, not part of the contract
        return JSONResponse({**info, "server": state.extra_info})

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if await aengine.run_control(engine.flush_cache):
            return JSONResponse({"success": True, "message": "cache flushed"})
        return error_response("cache not flushed: requests are running; retry when idle",
                              status=400, kind="cache_busy")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await parse_body(request, AbortRequest)
        if body.abort_all:
            return JSONResponse({"success": True, "aborted": await aengine.abort_all()})
        if body.rid is None:
            raise RequestError("give 'rid' or set 'abort_all' to true", "rid", None)
        return JSONResponse({"success": await aengine.abort(body.rid)})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await aengine.run_control(state.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "jengine", "root": state.model_path,
            "max_model_len": state.limits.request.max_context}]})
