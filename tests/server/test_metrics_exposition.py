"""/metrics stays valid whatever a client sends: label values escaped, route templates as the
endpoint label (no series per raw path). Protocol-level: no model needed."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.metrics import Counter

# One sample line of the text exposition format: name{label="value",...} number
SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]+="(\\.|[^"\\\n])*",?)*\})? \S+$')


def _valid(page: str) -> None:
    for line in page.splitlines():
        if line and not line.startswith("#"):
            assert SAMPLE.match(line), line


def test_label_values_are_escaped():
    c = Counter("x_total", "x", ("endpoint",))
    c.inc(1, 'a"b\\c\nd')
    _valid("\n".join(c.render()))
    assert 'endpoint="a\\"b\\\\c\\nd"' in c.render()[-1]


def test_hostile_paths_neither_break_nor_grow_the_metrics():
    client = TestClient(build_app({}, ServerSettings(admin_api_key="k")))
    for name in ('a"b', "x%0Ay", "q1", "q2", "q3"):
        r = client.post(f"/admin/models/{name}/promote", json={"version": "v"})
        assert r.status_code == 401
    client.get("/no/such/route")
    page = client.get("/metrics").text
    _valid(page)
    endpoints = set(re.findall(r'dsinfer_requests_total\{endpoint="([^"]*)"', page))
    assert endpoints == {"/admin/models/{name}/promote", "unmatched"}, endpoints
