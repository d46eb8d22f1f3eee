"""Reading a request safely: auth header, body (size, time, media type), JSON, schema.

Everything a client can send is refused here with a 4xx naming the problem, before a handler
or the engine sees it: oversized or slow bodies, a body that is not JSON, JSON nested too deep,
integers too long to parse, lone UTF-16 surrogates (valid JSON, but no tokenizer can encode
them), and non-ASCII bearer tokens.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from dsinfer.server.errors import APIError

# Deeper than any request schema needs (a chat content part is 4 levels down); json.loads
# itself would recurse ~1000 levels before failing with RecursionError.
MAX_JSON_DEPTH = 32
JSON_MEDIA_TYPES = ("application/json",)


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def keys_match(token: str | None, key: str) -> bool:
    """Constant-time compare that takes any header text (compare_digest refuses non-ASCII
    str, which made a non-ASCII token a 500)."""
    if token is None:
        return False
    return secrets.compare_digest(
        token.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape")
    )


def _check_media_type(request: Request) -> None:
    """A body with a Content-Type must say JSON; none at all is taken as JSON (curl -d sends
    a form type, which is refused with the fix in the message)."""
    ctype = request.headers.get("content-type")
    if ctype is None:
        return
    media = ctype.split(";", 1)[0].strip().lower()
    if media in JSON_MEDIA_TYPES or media.endswith("+json"):
        return
    raise APIError(
        415,
        f"Content-Type {media or ctype!r} is not JSON; send the body as "
        "'Content-Type: application/json'",
        code="unsupported_media_type",
    )


async def _read_body(request: Request, limit: int) -> bytes:
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
    return b"".join(chunks)


def check_json_value(value: Any, where: str = "body", depth: int = 0) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings with lone surrogates, naming the
    place (`messages[0].content`)."""
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels at '{where}'")
    if isinstance(value, str):
        _check_text(value, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            check_json_value(v, k if where == "body" else f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_json_value(v, f"{where}[{i}]", depth + 1)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise APIError(
            400,
            f"'{where}' holds a lone UTF-16 surrogate (\\u{ord(bad):04x}) at character "
            f"{e.start}: it is not Unicode text; send valid UTF-8/UTF-16 pairs",
            param=where.split(".", 1)[0].split("[", 1)[0],
        ) from None


async def read_json(request: Request, limit: int, timeout_s: float = 30.0) -> Any:
    """The body as checked JSON. A body slower than `timeout_s` (or cut short of its
    Content-Length) answers 408 instead of holding the connection."""
    _check_media_type(request)
    try:
        raw = await asyncio.wait_for(_read_body(request, limit), timeout_s)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout_s:g} s (shorter than its "
            "Content-Length?)",
            code="request_timeout",
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(
            400, f"malformed JSON body: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise APIError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # e.g. an integer past Python's 4300-digit conversion limit
        raise APIError(400, f"unreadable JSON value: {e}") from None
    check_json_value(data)
    return data


def parse(model: type[BaseModel], data: Any, lenient: bool = False) -> Any:
    """Validate a body against a request model; models with `screen` first refuse (or, with
    `lenient`, drop) fields they do not implement, naming them."""
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object")
    screen = getattr(model, "screen", None)
    if screen is not None:
        data = screen(data, lenient)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"] if not isinstance(x, int)]
        param = loc[0] if loc else None
        where = ".".join(str(x) for x in err["loc"])
        # A rule across fields (best_of with n, tool_choice with tools) has no location.
        subject = f"invalid '{where}'" if where else "invalid request"
        raise APIError(400, f"{subject}: {err['msg']}", param=param) from None
