"""FastAPI app: routes, auth, body limits and OpenAI-style errors."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from dsinfer.registry.store import ModelRegistry, RegistryError, Version
from dsinfer.sampling import check_token_ids
from dsinfer.server.admin import admin_router, bearer_token
from dsinfer.server.async_engine import EngineDeadError
from dsinfer.server.chat import chat_completion
from dsinfer.server.completions import completion
from dsinfer.server.metrics import ServerMetrics
from dsinfer.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from dsinfer.server.serving import ServedModel

logger = logging.getLogger(__name__)


class ServerSettings(BaseModel):
    api_key: str | None = None
    admin_api_key: str | None = None  # guards /admin/; the admin API is off without it
    max_queued_requests: int = 256
    max_body_bytes: int = 4 * 1024 * 1024


def as_registry(models: ModelRegistry | dict[str, ServedModel]) -> ModelRegistry:
    """A registry from a plain {name: ServedModel} (one version each) or itself."""
    if isinstance(models, ModelRegistry):
        return models
    registry = ModelRegistry()
    for name, served in models.items():
        registry.add(name, Version.of(served, name))
    return registry


async def read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(
            413,
            f"request body of {length} bytes exceeds the {limit}-byte limit",
            code="request_too_large",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(
                413, f"request body exceeds the {limit}-byte limit", code="request_too_large"
            )
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(
            400, f"malformed JSON body: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None


def parse(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"] if not isinstance(x, int)]
        param = loc[0] if loc else None
        where = ".".join(str(x) for x in err["loc"])
        raise APIError(400, f"invalid '{where}': {err['msg']}", param=param) from None


def build_app(
    models: ModelRegistry | dict[str, ServedModel],
    settings: ServerSettings,
    metrics: ServerMetrics | None = None,
    build_version: Callable[[str, str], ServedModel] | None = None,
) -> FastAPI:
    """The HTTP app over a registry of models and versions. `build_version(name, path)` loads a
    new version for the admin API (verified under the server's trust policy)."""
    app = FastAPI(title="dsinfer", version="0.1.0")
    metrics = metrics or ServerMetrics()
    registry = as_registry(models)
    app.state.registry = registry
    app.state.metrics = metrics

    @app.middleware("http")
    async def _version_header(request: Request, call_next: Callable) -> Any:
        response = await call_next(request)
        served_by = getattr(request.state, "served_by", None)
        if served_by is not None:
            response.headers["x-dsinfer-model"] = served_by
        return response

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.requests.inc(1, request.url.path, str(exc.status))
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        metrics.requests.inc(1, request.url.path, "500")
        return JSONResponse(
            APIError(500, f"internal error: {exc}", "server_error").body(), status_code=500
        )

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        token = bearer_token(request) or ""
        if not secrets.compare_digest(token, settings.api_key):
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

    def admit(served: ServedModel) -> None:
        eng = served.engine
        queued = eng.num_pending - len(eng.engine.scheduler.running)
        if queued >= settings.max_queued_requests:
            raise APIError(
                429,
                f"server busy: {queued} requests queued (limit "
                f"{settings.max_queued_requests}); retry shortly",
                "rate_limit_error",
                headers={"Retry-After": "1"},
            )

    async def handle(
        request: Request, schema: type[BaseModel], run: Callable[..., Awaitable[Any]]
    ) -> Any:
        authorize(request)
        body = parse(schema, await read_json(request, settings.max_body_bytes))
        served = pick(request, body.model, body.user)
        admit(served)
        try:
            result = await run(served, body, metrics, request)
        except ValueError as e:  # the engine refused the request (e.g. larger than the KV pool)
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error") from None
        if not isinstance(result, StreamingResponse):
            metrics.requests.inc(1, request.url.path, "200")
        return result

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Any:
        return await handle(request, ChatCompletionRequest, chat_completion)

    @app.post("/v1/completions")
    async def _completions(request: Request) -> Any:
        return await handle(request, CompletionRequest, completion)

    @app.get("/v1/models")
    async def _models(request: Request) -> dict:
        authorize(request)
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
        return {"object": "list", "data": data}

    @app.get("/health")
    async def _health() -> JSONResponse:
        dead = [m.name for m in registry.served() if m.engine.dead is not None]
        if dead:
            return JSONResponse({"status": "error", "dead": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def _metrics() -> PlainTextResponse:
        for m in registry.served():
            if m.engine.engine is not None:
                metrics.update_engine(m.name, m.engine.engine)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def _tokenize(request: Request) -> dict:
        authorize(request)
        body = parse(TokenizeRequest, await read_json(request, settings.max_body_bytes))
        served = pick(request, body.model)
        if body.messages is not None:
            msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = served.tokenizer.encode_chat(msgs)
        elif body.prompt is not None:
            ids = served.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "send 'prompt' or 'messages'", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len}

    @app.post("/detokenize")
    async def _detokenize(request: Request) -> dict:
        authorize(request)
        body = parse(DetokenizeRequest, await read_json(request, settings.max_body_bytes))
        served = pick(request, body.model)
        try:
            check_token_ids(body.tokens, served.tokenizer.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from None
        return {"prompt": served.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    app.include_router(admin_router(registry, settings, build_version))
    return app
