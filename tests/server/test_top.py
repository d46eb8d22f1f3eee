"""`dsinfer top --once` against a real server under load, and the percentile arithmetic."""

from __future__ import annotations

import math
import threading

import httpx
import pytest

from dsinfer.cli import main
from dsinfer.server.api import ServerSettings, build_app
from dsinfer.top import quantile
from tests.server.conftest import running_server, wait_idle


def test_quantile_between_two_scrapes():
    before = [(0.1, 10.0), (0.5, 10.0), (math.inf, 10.0)]
    now = [(0.1, 10.0), (0.5, 30.0), (math.inf, 30.0)]  # 20 new observations in (0.1, 0.5]
    assert quantile(now, before, 0.5) == pytest.approx(0.3)
    assert quantile(now, before, 1.0) == pytest.approx(0.5)
    assert math.isnan(quantile(before, before, 0.5))  # nothing new


def test_top_once_shows_a_busy_server(tiny_smol, capsys):
    app = build_app({"tiny": tiny_smol}, ServerSettings(api_key="k"))
    with running_server(app) as url:
        stop = threading.Event()

        def load() -> None:
            with httpx.Client(headers={"Authorization": "Bearer k"}, timeout=60) as c:
                while not stop.is_set():
                    c.post(f"{url}/v1/completions",
                           json={"prompt": "w5 w6", "max_tokens": 64, "ignore_eos": True})  # fmt: skip

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            assert main(["top", url, "--once", "--interval", "1.5", "--api-key", "k"]) == 0
        finally:
            stop.set()
            for t in threads:
                t.join(60)
    out = capsys.readouterr().out
    assert "\x1b" not in out  # not a terminal: no control characters
    row = next(line for line in out.splitlines() if line.lstrip("│ ").startswith("tiny"))
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[0] == "tiny"
    running, gen_tps = float(cells[1]), float(cells[4])
    assert running >= 1 and gen_tps > 0, row
    assert "RSS" in out and "MBU" in out
    wait_idle(tiny_smol)
