"""FastAPI app: routes, auth, body limits and OpenAI-style errors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsinfer.registry.store import ModelRegistry, RegistryError, Version
from dsinfer.sampling import check_token_ids
from dsinfer.server import openapi
from dsinfer.server.admin import BODIES, admin_router
from dsinfer.server.chat import chat_completion
from dsinfer.server.completions import completion
from dsinfer.server.errors import APIError
from dsinfer.server.http_io import bearer_token, keys_match, parse, read_json
from dsinfer.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from dsinfer.server.metrics import ServerMetrics
from dsinfer.server.middleware import ServerMiddleware
from dsinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from dsinfer.server.responses import (
    ChatCompletion,
    Completion,
    Detokenized,
    Health,
    ModelCard,
    ModelList,
    Tokenized,
)
from dsinfer.server.serving import ServedModel, as_api_error
from dsinfer.server.settings import ServerSettings
from dsinfer.server.stats_log import StatsLogger

logger = logging.getLogger(__name__)


def as_registry(models: ModelRegistry | dict[str, ServedModel]) -> ModelRegistry:
    """A registry from a plain {name: ServedModel} (one version each) or itself."""
    if isinstance(models, ModelRegistry):
        return models
    registry = ModelRegistry()
    for name, served in models.items():
        registry.add(name, Version.of(served, name))
    return registry


def route_of(request: Request) -> str:
    """The matched route's template (`/admin/models/{name}/promote`), never the raw path: a
    client must not be able to create metric series at will."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def build_app(
    models: ModelRegistry | dict[str, ServedModel],
    settings: ServerSettings,
    metrics: ServerMetrics | None = None,
    build_version: Callable[[str, str], ServedModel] | None = None,
) -> FastAPI:
    """The HTTP app over a registry of models and versions. `build_version(name, path)` loads a
    new version for the admin API (verified under the server's trust policy)."""
    app = FastAPI(title="dsinfer", version="0.1.0")
    registry = as_registry(models)
    metrics = metrics or ServerMetrics(registry.served)
    app.state.registry = registry
    app.state.settings = settings  # read by route dependencies (admin bodies)
    app.state.metrics = metrics
    app.state.log_prompts = settings.log_prompts
    if settings.stats_interval_s > 0:
        stats = StatsLogger(metrics, registry.served)

        @app.on_event("startup")
        async def _start_stats() -> None:
            app.state.stats_task = asyncio.create_task(stats.run(settings.stats_interval_s))

    app.add_middleware(ServerMiddleware, api_key=settings.api_key, public_docs=settings.public_docs)

    async def body_of(request: Request, schema: type[BaseModel]) -> Any:
        data = await read_json(request, settings.max_body_bytes, settings.body_timeout_s)
        return parse(schema, data, settings.lenient_fields)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.requests.labels(route_of(request), str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and methods answer in the OpenAI error shape too."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = (
            f"no route {request.method} {request.url.path}"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        metrics.requests.labels("unmatched", str(exc.status_code)).inc()
        return JSONResponse(
            APIError(exc.status_code, message, code=code).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        metrics.requests.labels(route_of(request), "500").inc()
        return JSONResponse(
            APIError(500, f"internal error: {exc}", "server_error").body(), status_code=500
        )

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        if not keys_match(bearer_token(request), settings.api_key):
            raise APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer KEY'",
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def pick(request: Request, name: str | None, user: str | None = None) -> ServedModel:
        try:
            served = registry.resolve(name, user)
        except RegistryError as e:
            code = "model_not_found" if e.status == 404 else None
            raise APIError(e.status, str(e), param="model", code=code) from None
        request.state.served_by = served.name
        if served.engine.dead is not None:
            raise APIError(
                503, "the model's engine has stopped; see the server log", "server_error"
            )
        return served

    def admit(served: ServedModel, wanted: int) -> None:
        """Refuse (429) when the queue is full. Requests are submitted to the engine in the
        same event-loop turn as this check, so a burst cannot slip past it."""
        limit = settings.max_queued_requests
        if wanted > limit:
            raise APIError(
                400,
                f"this request asks for {wanted} generations (prompts x n) but the server "
                f"queues at most {limit}; split it into smaller requests",
                param="n",
            )
        eng = served.engine
        queued = eng.num_pending - eng.num_running
        if queued + wanted > limit:
            raise APIError(
                429,
                f"server busy: {queued} requests queued (limit {limit}); retry shortly",
                "rate_limit_error",
                headers={"Retry-After": "1"},
            )

    # The user key, checked before a route reads its body (the admin routes have their own).
    keyed = [Depends(authorize)]

    async def handle(
        request: Request, schema: type[BaseModel], run: Callable[..., Awaitable[Any]]
    ) -> Any:
        body = await body_of(request, schema)
        served = pick(request, body.model, body.user)
        await served.prepare_constraint(body)  # before admit: no await between it and submit
        admit(served, body.num_generations())
        try:
            result = await run(served, body, metrics, request)
        except Exception as e:  # refused by the engine, failed alone, or the engine stopped
            raise as_api_error(e) from e
        metrics.requests.labels(route_of(request), "200").inc()  # streamed: their 200 is sent
        return result

    @app.post(
        "/v1/chat/completions",
        dependencies=keyed,
        openapi_extra=openapi.body_of(ChatCompletionRequest),
        responses=openapi.generation(ChatCompletion),
    )
    async def _chat(request: Request) -> Any:
        return await handle(request, ChatCompletionRequest, chat_completion)

    @app.post(
        "/v1/completions",
        dependencies=keyed,
        openapi_extra=openapi.body_of(CompletionRequest),
        responses=openapi.generation(Completion),
    )
    async def _completions(request: Request) -> Any:
        return await handle(request, CompletionRequest, completion)

    @app.get("/v1/models", dependencies=keyed, responses=openapi.answers(ModelList, 401))
    async def _models() -> dict:
        return {"object": "list", "data": model_cards()}

    @app.get(
        "/v1/models/{model_id:path}",
        dependencies=keyed,
        responses=openapi.answers(ModelCard, 401, 404),
    )
    async def _model(model_id: str) -> dict:
        for card in model_cards():
            if card["id"] == model_id:
                return card
        raise APIError(
            404, f"model {model_id!r} is not served", param="model", code="model_not_found"
        )

    def model_cards() -> list[dict]:
        data = []
        for entry in registry.entries.values():
            first = next(iter(entry.versions.values())).served
            routed = {"id": entry.name, "object": "model", "created": first.created}
            routed |= {"owned_by": "dsinfer", "max_model_len": first.max_model_len}
            routed["version"] = first.version if len(entry.versions) == 1 else None
            routed["weights"] = {v: round(w, 6) for v, w in entry.weights.items()}
            data.append(routed)
            for v in entry.versions.values():
                if v.served.name == entry.name:
                    continue  # an unversioned checkpoint is listed once, by its name
                m = v.served
                data.append(
                    {
                        "id": m.name,
                        "object": "model",
                        "created": m.created,
                        "owned_by": "dsinfer",
                        "max_model_len": m.max_model_len,
                        "version": m.version,
                        "label": v.label,
                        "root": entry.name,
                    }
                )
        return data

    @app.get("/health", responses={200: {"model": Health}, 503: {"model": Health}})
    async def _health() -> JSONResponse:
        """200 while every engine serves; 503 while one restarts or after one stopped. Each
        engine's restarts and last fault say what happened."""
        engines = {
            m.name: {
                "state": m.engine.state,
                "restarts": m.engine.restarts,
                "last_fault": m.engine.last_fault,
            }
            for m in registry.served()
        }
        dead = [n for n, e in engines.items() if e["state"] == "dead"]
        restarting = [n for n, e in engines.items() if e["state"] == "restarting"]
        status = "error" if dead else "restarting" if restarting else "ok"
        body = {"status": status, "engines": engines}
        if dead:
            body["dead"] = dead
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def _metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.post(
        "/tokenize",
        dependencies=keyed,
        openapi_extra=openapi.body_of(TokenizeRequest),
        responses=openapi.answers(Tokenized, *openapi.BODY, 401, *openapi.MODEL),
    )
    async def _tokenize(request: Request) -> dict:
        body = await body_of(request, TokenizeRequest)
        served = pick(request, body.model)
        if body.messages is not None:
            try:
                msgs = [m.for_template() for m in body.messages]
                ids = served.tokenizer.encode_chat(msgs)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
        elif body.prompt is not None:
            ids = served.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "send 'prompt' or 'messages'", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len}

    @app.post(
        "/detokenize",
        dependencies=keyed,
        openapi_extra=openapi.body_of(DetokenizeRequest),
        responses=openapi.answers(Detokenized, *openapi.BODY, 401, *openapi.MODEL),
    )
    async def _detokenize(request: Request) -> dict:
        body = await body_of(request, DetokenizeRequest)
        served = pick(request, body.model)
        try:
            check_token_ids(body.tokens, served.tokenizer.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from None
        return {"prompt": served.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    app.include_router(admin_router(registry, settings, build_version))
    openapi.install(
        app,
        [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, *BODIES],
        api_key=settings.api_key is not None,
    )
    return app
