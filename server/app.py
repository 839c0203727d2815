"""The FastAPI app: routes only; the work lives in preprocess / generation / streaming.

`build_app` takes an AsyncEngine that may not be loaded yet: the lifespan loads it in
the background, so `/health` answers at once and `/ready` says 503 until the model is
in memory (what an orchestrator's readiness probe needs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from attention.sizing import KVPoolTooSmall
from policies.catalog import describe_policies
from scheduler.async_engine import AsyncEngine, EngineUnavailable, QueueFull
from scheduler.engine_process import freeze_heap
from scheduler.outputs import RequestRejected
from server.errors import (
    APIError,
    bad_request,
    error_body,
    install_error_handlers,
    validation_error,
)
from server.generation import ClientDisconnected, Generation
from server.metrics import ServerMetrics
from server.middleware import APIKeyAuth, BodySizeLimit, HTTPMetrics
from server.preprocess import Plan, Preprocessor
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from server.responses import TokenText, chat_body, completion_body
from server.responses_api import ResponseStore, Turn, plan_turn
from server.responses_api.request import ResponsesFields, renamed_error
from server.settings import ServerSettings
from server.streaming import SSEResponse, stream_events
from server.tenants import Tenant

logger = logging.getLogger("kvserve.server")
ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready",
          "/metrics", "/version", "/tokenize", "/detokenize", "/v1/kv_policies",
          "/v1/responses"}
# Paths with an id in them share one metrics label each.
ROUTE_PREFIXES = {"/v1/models/": "/v1/models/{model}",
                  "/v1/responses/": "/v1/responses/{response_id}"}


def kvserve_version() -> str:
    try:
        return metadata.version("kvserve")
    except metadata.PackageNotFoundError:
        return "0.1.0+source"


async def _json(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}"[:500]) from None


async def _parse(request: Request, schema: type[BaseModel], data: Any = None) -> Any:
    if data is None:
        data = await _json(request)
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None


def _tenant(request: Request) -> Tenant | None:
    """The tenant whose API key the auth middleware matched (None without keys)."""
    return request.scope.get("state", {}).get("tenant")


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(engine, tenants=settings.tenant_names)
    pre = Preprocessor(engine, settings)
    stored = ResponseStore(settings.responses_store_size)  # previous_response_id's
    started = int(time.time())
    token_text: list[TokenText] = []

    def tt() -> TokenText:
        if not token_text:
            token_text.append(TokenText(engine.tokenizer))
        return token_text[0]

    engine.on_dead = settings.on_fatal  # the engine process died: exit, to be restarted

    async def load() -> None:
        t0 = time.perf_counter()
        try:
            await engine.start()
        except Exception as e:
            if isinstance(e, KVPoolTooSmall):  # the user's to fix: the message says how
                logger.error("the KV pool cannot be sized: %s", e)
            else:
                logger.exception("the model failed to load")
            if settings.on_fatal is not None:
                settings.on_fatal(e)
            return
        # torch + transformers leave ~400k long-lived objects; a full collection over them
        # stalls every thread for ~0.2 s. Freezing them keeps GC pauses to what requests
        # allocate, so the event loop stays responsive under load (the engine process
        # freezes its own heap the same way).
        freeze_heap()
        logger.info("model loaded", extra={"fields": {
            "model": settings.model_path, "load_s": round(time.perf_counter() - t0, 2),
            "max_model_len": engine.max_model_len, "kv_blocks": engine.stats.blocks_total,
            "engine_layout": engine.layout, "engine_pid": engine.engine_pid}})

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(load(), name="kvserve-load")
        try:
            yield
        finally:
            await asyncio.gather(task, return_exceptions=True)
            await engine.shutdown()
            pre.close()

    app = FastAPI(title="kvserve", version=kvserve_version(), lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings
    logging.getLogger("kvserve.request").disabled = not settings.request_log
    install_error_handlers(app)

    async def serve(request: Request, plan: Plan, turn: Turn | None = None) -> Response:
        try:
            gen = await Generation.start(engine, plan)
        except (QueueFull, RequestRejected, EngineUnavailable) as e:
            reason = {QueueFull: "queue_full", RequestRejected: "invalid"}.get(type(e),
                                                                             "unavailable")
            metrics.rejected.labels(reason).inc()
            if isinstance(e, RequestRejected) and e.param == "max_tokens":
                e.param = plan.max_tokens_param
            raise
        if plan.stream:
            return SSEResponse(turn.events(gen) if turn else stream_events(gen, tt()))
        try:
            choices = await gen.collect_unless_disconnected(request)
        except ClientDisconnected:
            gen.close("disconnected")
            return Response(status_code=499)
        except BaseException:
            gen.close("error")
            raise
        gen.close()
        if turn is not None:
            return JSONResponse(turn.body(gen, choices))
        body = (chat_body if plan.kind == "chat" else completion_body)(gen, choices, tt())
        return JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, CompletionRequest)
        engine.check_admission(0, 0)
        plan = await pre.completion(req, _tenant(request))
        plan.arrival_time = arrival
        return await serve(request, plan)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, ChatCompletionRequest)
        engine.check_admission(0, 0)
        plan = await pre.chat(req, _tenant(request))
        plan.arrival_time = arrival
        return await serve(request, plan)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, run as a chat request (server/responses_api/)."""
        arrival = time.monotonic()
        data = await _json(request)
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        fields = await _parse(request, ResponsesFields, data)
        engine.check_admission(0, 0)
        turn = await plan_turn(pre, stored, data, fields, _tenant(request))
        turn.plan.arrival_time = arrival
        try:
            return await serve(request, turn.plan, turn)
        except Exception as e:  # the engine's 400s name the Responses field
            raise renamed_error(e) from None

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> dict[str, Any]:
        found = stored.get(response_id, (t := _tenant(request)) and t.name)
        if found is None:
            raise APIError(404, f"Response with id '{response_id}' not found.",
                           param="response_id", code="not_found")
        return found.body

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": started, "owned_by": "kvserve",
                "root": settings.model_path, "max_model_len": engine.max_model_len or None}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in settings.served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        """`client.models.retrieve(id)`; `:path` because served names may hold a `/`
        (`org/model`, as Hugging Face ids do)."""
        if model_id not in settings.served_model_names:
            raise APIError(404, f"The model `{model_id}` does not exist. Served models: "
                           f"{', '.join(settings.served_model_names)}", param="model",
                           code="model_not_found")
        return model_card(model_id)

    @app.get("/v1/kv_policies")
    async def kv_policies() -> dict[str, Any]:
        """What each `kv_policy` keeps and the defaults it gets on this model (a default
        budget is a share of max_model_len: policies/config.py `CONTEXT_DEFAULTS`)."""
        default = engine.limits.default_kv_policy.name if engine.limits else "full"
        data = [{"object": "kv_policy", **p, "server_default": p["name"] == default}
                for p in describe_policies(engine.max_model_len or None)]
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        data = await _json(request)
        chat = isinstance(data, dict) and "messages" in data
        req = await _parse(request, TokenizeChatRequest if chat else TokenizeCompletionRequest,
                           data)
        engine.check_admission(0, 0)
        return await pre.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, DetokenizeRequest)
        engine.check_admission(0, 0)
        return await pre.detokenize(req)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: up while loading and draining; down once the engine failed to load
        or its process died (the server is exiting then; a restart is the cure)."""
        if engine.load_error is not None:
            return JSONResponse(error_body(f"the engine failed: {engine.load_error}",
                                           "service_unavailable", None, "failed"),
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if engine.ready:
            return JSONResponse({"status": "ready"})
        try:
            engine.check_admission(0, 0)
            reason, msg = "stopped", "the engine is stopping"
        except EngineUnavailable as e:
            reason, msg = e.reason, str(e)
        return JSONResponse(error_body(msg, "service_unavailable", None, reason),
                            status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        import torch
        import transformers

        return {"version": kvserve_version(), "torch": torch.__version__,
                "transformers": transformers.__version__}

    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(APIKeyAuth, tenants=settings.tenants)
    app.add_middleware(HTTPMetrics, counter=metrics.http, routes=ROUTES,
                       prefixes=ROUTE_PREFIXES)
    return app


__all__ = ["APIError", "build_app"]
