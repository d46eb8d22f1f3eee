"""A server that says what it does: request ids, the access log, a record per finished request
(JSON with --log-format json, prompt text only with --log-prompts), the busy-time stats line."""

from __future__ import annotations

import json
import logging

import httpx

from dsinfer.logs import JsonFormatter
from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.stats_log import StatsLogger
from tests.server.conftest import running_server

BODY = {"prompt": "w5 w6 secret words", "max_tokens": 3, "ignore_eos": True}


def _records(caplog, name: str) -> list[logging.LogRecord]:  # noqa: ANN001
    return [r for r in caplog.records if r.name == name]


def test_request_id_access_log_and_request_record(tiny_smol, caplog):
    caplog.set_level(logging.INFO)
    with running_server(build_app({"tiny": tiny_smol}, ServerSettings())) as url:
        r = httpx.post(f"{url}/v1/completions", json=BODY, headers={"x-request-id": "abc-123"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
        bad = httpx.post(f"{url}/v1/completions", json=BODY, headers={"x-request-id": "x" * 500})
        assert len(bad.headers["x-request-id"]) == 32  # refused as too long: a new one
        httpx.get(f"{url}/v1/models/no-such-model")
    access = [r.getMessage() for r in _records(caplog, "dsinfer.access")]
    assert any(m.startswith("POST /v1/completions 200 ") and m.endswith("abc-123") for m in access)
    assert any(m.startswith("GET /v1/models/{model_id") and " 404 " in m for m in access), access
    (record,) = [r.record for r in _records(caplog, "dsinfer.requests") if r.record["request_id"] == "abc-123"]  # fmt: skip
    assert record["model"] == "tiny" and record["completion_tokens"] == 3
    assert record["finish_reason"] == "length" and record["prompt_tokens"] > 0
    assert record["ttft_s"] is not None and record["e2e_s"] >= record["ttft_s"]
    assert "prompt" not in record  # no prompt text without --log-prompts
    line = json.loads(JsonFormatter().format(_records(caplog, "dsinfer.requests")[0]))
    assert line["logger"] == "dsinfer.requests" and "request_id" in line and "e2e_s" in line


def test_prompts_are_logged_only_when_asked(tiny_smol, caplog):
    caplog.set_level(logging.INFO)
    with running_server(build_app({"tiny": tiny_smol}, ServerSettings(log_prompts=True))) as url:
        httpx.post(f"{url}/v1/completions", json=BODY, headers={"x-request-id": "p1"})
    (record,) = [r.record for r in _records(caplog, "dsinfer.requests") if r.record["request_id"] == "p1"]  # fmt: skip
    assert record["prompt"] == BODY["prompt"]


def test_stats_line_while_busy_and_silence_when_idle(tiny_smol):
    app = build_app({"tiny": tiny_smol}, ServerSettings(stats_interval_s=0))
    stats = StatsLogger(app.state.metrics, app.state.registry.served)
    stats.lines(1.0)  # baseline
    with running_server(app) as url:
        httpx.post(f"{url}/v1/completions", json=BODY)
    (line,) = stats.lines(1.0)
    assert line.startswith("tiny: prompt ") and "generation 3.0 tok/s" in line, line
    assert stats.lines(1.0) == []  # nothing happened since


def test_json_log_format_from_the_command_line(tmp_path):
    import subprocess
    import sys

    from tests.helpers import tiny_llama_dir

    model = tiny_llama_dir(tmp_path, num_layers=1)
    r = subprocess.run(
        [sys.executable, "-m", "dsinfer", "--log-format", "json", "generate", "--model",
         str(model), "--prompt", "w5", "--max-tokens", "2", "--num-kv-blocks", "8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(line) for line in r.stderr.splitlines() if line.strip()]
    assert lines and all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    assert any(x["logger"] == "dsinfer.models.loader" for x in lines)
