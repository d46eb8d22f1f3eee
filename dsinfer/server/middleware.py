"""Plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which wraps `receive` and so hid
a client's disconnect from non-streaming handlers: their requests ran on, holding KV blocks).

- `x-dsinfer-model`: which model@version served the request (set by the route in scope state).
- `x-request-id`: the client's (when it is printable and at most 128 characters) or a new one;
  echoed in the response, kept in scope state for the handlers' logs.
- The access log: one line per request on the `dsinfer.access` logger (method, route
  template, status, latency, request id).
- Under `--api-key`, the API description (/docs, /redoc, /openapi.json) needs the key too,
  unless the server was started with `--public-docs`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from dsinfer.server.errors import APIError
from dsinfer.server.http_io import keys_match

access_log = logging.getLogger("dsinfer.access")
MAX_REQUEST_ID = 128

DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def _bearer(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token if scheme.lower() == "bearer" and token else None
    return None


class ServerMiddleware:
    def __init__(self, app: Any, api_key: str | None, public_docs: bool) -> None:
        self.app, self.api_key, self.public_docs = app, api_key, public_docs

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (
            self.api_key is not None
            and not self.public_docs
            and scope["path"] in DOC_PATHS
            and not keys_match(_bearer(scope), self.api_key)
        ):
            await _send_error(
                send,
                APIError(
                    401,
                    "the API description needs the API key too (start the server with "
                    "--public-docs to open it)",
                    "authentication_error",
                    code="invalid_api_key",
                ),
            )
            return
        state = scope.setdefault("state", {})
        state["request_id"] = rid = _request_id(scope)
        start, status = time.perf_counter(), [0]

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", rid.encode()))
                served_by = state.get("served_by")
                if served_by is not None:
                    headers.append((b"x-dsinfer-model", served_by.encode("utf-8")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            route = scope.get("route")
            access_log.info(
                "%s %s %d %.1fms %s",
                scope["method"],
                getattr(route, "path", None) or "unmatched",  # the template: no raw paths
                status[0],
                1e3 * (time.perf_counter() - start),
                rid,
            )


def _request_id(scope: dict[str, Any]) -> str:
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_REQUEST_ID and text.isprintable() and text.isascii():
                return text
            break
    return uuid.uuid4().hex


async def _send_error(send: Any, err: APIError) -> None:
    body = json.dumps(err.body()).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
