"""ServerSettings: the HTTP server's own options (keys, limits, logging), apart from the engines'.

Its own module so that every route module (api, admin) can take it typed without importing the
app builder."""

from __future__ import annotations

from pydantic import BaseModel


class ServerSettings(BaseModel):
    api_key: str | None = None
    admin_api_key: str | None = None  # guards /admin/; the admin API is off without it
    max_queued_requests: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout_s: float = 30.0  # a body slower than this (or cut short) answers 408
    public_docs: bool = False  # /docs and /openapi.json without the API key
    lenient_fields: bool = False  # drop (and log) unknown request fields instead of 400
    log_prompts: bool = False  # the request log carries the prompt text (off: privacy)
    stats_interval_s: float = 10.0  # a stats line this often while busy (0: never)
