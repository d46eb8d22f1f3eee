"""`dsinfer bench serve --compare` against a second real server writes both series, the report
and the plots; `bench report` redraws them; progress is plain log lines off a terminal."""

from __future__ import annotations

import json
import logging

from dsinfer.cli import main
from dsinfer.progress import progress
from dsinfer.server.api import ServerSettings, build_app
from tests.server.conftest import running_server

PNG = b"\x89PNG\r\n\x1a\n"


def test_bench_serve_compare_writes_both_series_and_plots(tiny_smol, tmp_path, capsys):
    out = tmp_path / "run"
    with (
        running_server(build_app({"tiny": tiny_smol}, ServerSettings())) as a,
        running_server(build_app({"tiny": tiny_smol}, ServerSettings())) as b,
    ):
        rc = main(["bench", "serve", "--url", a, "--compare", b, "--label", "ours",
                   "--label", "theirs", "--concurrency", "1,2", "--num-requests", "4",
                   "--input-len", "8", "--output-len", "8", "--out", str(out)])  # fmt: skip
    assert rc == 0
    series = json.loads((out / "serve.json").read_text())
    assert set(series) == {"ours", "theirs"}
    assert [r["concurrency"] for r in series["theirs"]] == [1, 2]
    assert all(r["completed"] == 4 and r["output_tokens_per_s"] > 0 for s in series.values() for r in s)  # fmt: skip
    for png in ("throughput.png", "latency.png", "distribution.png"):
        assert (out / png).read_bytes().startswith(PNG), png
    md = (out / "report.md").read_text()
    assert "| theirs | 2 |" in md and "theirs at 2:" in md and "![latency](latency.png)" in md
    again = tmp_path / "again"
    assert main(["bench", "report", str(out / "serve.json"), "--out", str(again)]) == 0
    assert (again / "throughput.png").read_bytes().startswith(PNG)
    assert "\x1b" not in capsys.readouterr().out


def test_progress_off_a_terminal_is_plain_log_lines(caplog):
    caplog.set_level(logging.INFO, logger="dsinfer.progress")
    with progress("loading weights", 8) as advance:
        for _ in range(8):
            advance(1)
    lines = [r.getMessage() for r in caplog.records if r.name == "dsinfer.progress"]
    assert lines == [f"loading weights: {p}%" for p in (25, 50, 75, 100)]
    assert not any("\x1b" in line or "\r" in line for line in lines)
