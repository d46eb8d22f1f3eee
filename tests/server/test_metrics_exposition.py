"""/metrics stays valid whatever a client sends: every page parses with prometheus-client's own
parser, label values are escaped, routes are templates (no series per raw path)."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dsinfer.server.api import ServerSettings, build_app


def _families(page: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(page)}


def test_hostile_paths_neither_break_nor_grow_the_metrics():
    client = TestClient(build_app({}, ServerSettings(admin_api_key="k")))
    for name in ('a"b', "x%0Ay", "q1", "q2", "q3"):
        r = client.post(f"/admin/models/{name}/promote", json={"version": "v"})
        assert r.status_code == 401
    client.get("/no/such/route")
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=")
    families = _families(r.text)  # raises on a page Prometheus could not read
    routes = {s.labels["route"] for s in families["dsinfer:http_requests"].samples}
    assert routes == {"/admin/models/{name}/promote", "unmatched"}, routes
    assert "process_resident_memory_bytes" in families  # the standard process collector


def test_label_values_are_escaped():
    from dsinfer.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.requests.labels('a"b\\c\nd', "400").inc()
    families = _families(metrics.render().decode())
    (sample,) = [s for s in families["dsinfer:http_requests"].samples if s.name.endswith("_total")]
    assert sample.labels["route"] == 'a"b\\c\nd'  # round-trips through the exposition
