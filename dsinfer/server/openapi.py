"""/openapi.json (and so /docs) with the real request schemas, error answers and keys.

The routes read their bodies themselves (size, time, media type and depth limits come first,
server/http_io.py), so FastAPI cannot see their models; each route names its model here and the
schemas are added to the document's components. Each route lists the error statuses it can
answer (`errors`), all in the OpenAI error shape; FastAPI's own 422 is dropped, because this
server answers 400 for every invalid request. A schema-driven fuzzer checks the document against
the server (tests/server/test_schema_fuzz.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"
# The security schemes: the server's API key, and the admin API's own key.
API_KEY, ADMIN_KEY = "apiKey", "adminKey"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error answer's body, as OpenAI's API writes it."""

    error: ErrorDetail


_MEANING = {
    400: "Invalid request: the message names the field and what to send instead.",
    401: "Missing or wrong key: send 'Authorization: Bearer KEY'.",
    403: "This key may not use the admin API, or the server runs without one.",
    404: "No such model or version.",
    408: "The body did not arrive within the server's body timeout.",
    409: "Conflicts with the registry: already loaded, label taken, nothing to roll back.",
    413: "The body is larger than the server takes.",
    415: "The body is not JSON (its Content-Type).",
    429: "The queue is full: retry after the Retry-After header's seconds.",
    500: "This request failed alone (code request_failed); the server goes on serving.",
    503: "The model's engine is restarting (code engine_restarted: retry) or has stopped.",
}
BODY = (400, 408, 413, 415)  # a route that reads a JSON body
MODEL = (404, 503)  # a route that picks a served model
GENERATE = (*BODY, 401, *MODEL, 429, 500)


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses` for a route that can answer these error statuses."""
    return {c: {"model": ErrorResponse, "description": _MEANING[c]} for c in sorted(set(codes))}


def answers(model: type[BaseModel], *codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses` for a route whose 200 body is `model` (described, not enforced: the route
    returns its dict as it is) and that can answer these error statuses."""
    return {200: {"model": model}, **errors(*codes)}


def generation(answer: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """`responses` for a generation route: `answer` as JSON, or server-sent events with
    `stream: true`."""
    # No type: a fuzzer reads the schema as each event's, a code generator as the body's.
    events = {"schema": {"description": "events 'data: {chunk}', then 'data: [DONE]'"}}
    streamed = {
        "model": answer,
        "description": "The completion as JSON; with stream: true, server-sent events.",
        "content": {"text/event-stream": events},
    }
    return {200: streamed, **errors(*GENERATE)}


def body_of(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install(app: FastAPI, models: list[type[BaseModel]], api_key: bool) -> None:
    """Make `app.openapi()` include `models` (and the models they use) as components, the
    keys each route needs (`api_key`: whether the server has one) and no 422 answers."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = doc.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template=REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            for gone in ("HTTPValidationError", "ValidationError"):
                schemas.pop(gone, None)
            components["securitySchemes"] = {
                API_KEY: {"type": "http", "scheme": "bearer", "description": "--api-key"},
                ADMIN_KEY: {"type": "http", "scheme": "bearer", "description": "--admin-api-key"},
            }
            for path, ops in doc.get("paths", {}).items():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
                    key = ADMIN_KEY if path.startswith("/admin/") else API_KEY
                    if key == ADMIN_KEY or (api_key and "401" in op.get("responses", {})):
                        op["security"] = [{key: []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
