"""The admin API under /admin/, guarded by its own key (`--admin-api-key`, never the user key).

    GET    /admin/models                              models, versions, weights, in-flight
    POST   /admin/models/{name}/versions              {"path", "label"?}: verify, load, warm
    PUT    /admin/models/{name}/weights               {"weights": {"VERSION": 90, ...}}
    POST   /admin/models/{name}/promote               {"version"}: all traffic to it
    POST   /admin/models/{name}/rollback              the weights before the newest version
    DELETE /admin/models/{name}/versions/{version}    stop routing, drain, free

A load is verified under the server's trust policy before it takes traffic; a refused artifact
answers 400 and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from dsinfer.registry.store import ModelRegistry, RegistryError
from dsinfer.registry.swap import load_version, unload_version
from dsinfer.server import openapi
from dsinfer.server.errors import APIError
from dsinfer.server.http_io import bearer_token, keys_match, parse, read_json
from dsinfer.server.protocol import RequestModel
from dsinfer.server.settings import ServerSettings


class LoadRequest(RequestModel):
    path: str
    label: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,64}$")


class WeightsRequest(RequestModel):
    weights: dict[str, float]


class PromoteRequest(RequestModel):
    version: str


def json_body(schema: type[BaseModel]) -> Any:
    """A route dependency: the request's JSON body parsed into `schema` (400 naming the field),
    under the server's body limits."""

    async def parsed(request: Request) -> Any:
        settings = request.app.state.settings
        raw = await read_json(request, settings.max_body_bytes, settings.body_timeout_s)
        return parse(schema, raw)

    return Depends(parsed)


# Module level, so that FastAPI can resolve the annotations (this module defers them).
LoadBody = Annotated[LoadRequest, json_body(LoadRequest)]
WeightsBody = Annotated[WeightsRequest, json_body(WeightsRequest)]
PromoteBody = Annotated[PromoteRequest, json_body(PromoteRequest)]
BODIES = [LoadRequest, WeightsRequest, PromoteRequest]  # for /openapi.json
REGISTRY = (400, 404, 409)  # a registry operation's refusals (RegistryError.status)


def _documented(model: type[BaseModel]) -> dict[str, Any]:
    """A body route's OpenAPI: its body (read by json_body, unseen by FastAPI) and errors."""
    return {
        "openapi_extra": openapi.body_of(model),
        "responses": openapi.errors(*openapi.BODY, *REGISTRY),
    }


def admin_router(
    registry: ModelRegistry,
    settings: ServerSettings,
    build_version: Callable[[str, str], Any] | None,
) -> APIRouter:
    def authorize(request: Request) -> None:
        token = bearer_token(request)
        if token is None:
            raise APIError(
                401,
                "the admin API needs 'Authorization: Bearer ADMIN_KEY'",
                "authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        key = settings.admin_api_key
        if key is None or not keys_match(token, key):
            why = "the admin API is off (start with --admin-api-key)" if key is None else ""
            raise APIError(403, why or "this key may not use the admin API", "permission_error")

    # Every admin route needs the admin key: checked once, before the body is read.
    router = APIRouter(
        prefix="/admin", dependencies=[Depends(authorize)], responses=openapi.errors(401, 403)
    )

    def registry_call(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except RegistryError as e:
            raise APIError(e.status, str(e)) from None

    @router.get("/models")
    async def _list() -> dict:
        return {"models": registry.describe()}

    @router.post("/models/{name}/versions", status_code=201, **_documented(LoadRequest))
    async def _load(name: str, req: LoadBody) -> dict:
        if build_version is None:
            raise APIError(400, "this server cannot load versions (no engine settings)")
        try:
            version = await load_version(registry, name, req.path, build_version, req.label)
        except RegistryError as e:
            raise APIError(e.status, str(e)) from None
        except ValueError as e:  # refused by the trust policy, unreadable, unsupported
            raise APIError(400, f"cannot load {req.path}: {e}", code="load_refused") from None
        return {"model": version.served.name, "version": version.id, "weights": _w(name)}

    def _w(name: str) -> dict[str, float]:
        return registry.entry(name).weights

    @router.put("/models/{name}/weights", **_documented(WeightsRequest))
    async def _weights(name: str, req: WeightsBody) -> dict:
        return {"weights": registry_call(registry.set_weights, name, req.weights)}

    @router.post("/models/{name}/promote", **_documented(PromoteRequest))
    async def _promote(name: str, req: PromoteBody) -> dict:
        return {"weights": registry_call(registry.promote, name, req.version)}

    @router.post("/models/{name}/rollback", responses=openapi.errors(*REGISTRY))
    async def _rollback(name: str) -> dict:
        return {"weights": registry_call(registry.rollback, name)}

    @router.delete("/models/{name}/versions/{version}", responses=openapi.errors(*REGISTRY))
    async def _unload(name: str, version: str) -> dict:
        try:
            gone = await unload_version(registry, name, version)
        except RegistryError as e:
            raise APIError(e.status, str(e)) from None
        return {"unloaded": gone.served.name}

    return router
