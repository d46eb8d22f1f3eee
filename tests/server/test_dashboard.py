"""examples/grafana/dsinfer.json: every metric a query names is one a real server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dsinfer.server.api import ServerSettings, build_app
from tests.server.conftest import running_server

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "dsinfer.json"
# A metric name in PromQL: not a function, label, keyword or template variable.
NAME = re.compile(r"(?<![\w{$])((?:dsinfer:|process_)[A-Za-z0-9_:]+)")


def _queries(node) -> list[str]:  # noqa: ANN001
    if isinstance(node, dict):
        return [v for k, v in node.items() if k in ("expr", "query") and isinstance(v, str)] + [
            q for v in node.values() for q in _queries(v)
        ]
    if isinstance(node, list):
        return [q for v in node for q in _queries(v)]
    return []


def test_every_dashboard_query_names_an_exported_metric(tiny_smol):
    queries = _queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) >= 15
    with running_server(build_app({"tiny": tiny_smol}, ServerSettings())) as url:
        httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 2}, timeout=60)
        page = httpx.get(f"{url}/metrics").text
    exported = {s.name for f in text_string_to_metric_families(page) for s in f.samples}
    named = {m for q in queries for m in NAME.findall(q)}
    assert named, queries
    missing = sorted(named - exported)
    assert not missing, missing
