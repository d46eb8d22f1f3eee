"""A small queue limit: excess requests get 429 with Retry-After, never a 5xx."""

from __future__ import annotations

import threading

import httpx

from dsinfer.server.api import ServerSettings, build_app
from tests.server.conftest import running_server, wait_idle


def test_excess_requests_get_429_not_5xx(scripted):
    app = build_app({"smollm2": scripted}, ServerSettings(max_queued_requests=1))
    statuses: list[int] = []
    retry_after: list[str | None] = []
    with running_server(app) as url:

        def run() -> None:
            r = httpx.post(
                f"{url}/v1/completions",
                timeout=120,
                json={"prompt": "Count to fifty:", "max_tokens": 48, "ignore_eos": True},
            )
            statuses.append(r.status_code)
            if r.status_code == 429:
                retry_after.append(r.headers.get("retry-after"))
                assert r.json()["error"]["type"] == "rate_limit_error"

        threads = [threading.Thread(target=run) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert len(statuses) == 24
    assert all(s in (200, 429) for s in statuses), statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1
    assert all(ra == "1" for ra in retry_after)
    wait_idle(scripted)
