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


def _tiny_row(out: str) -> list[str]:
    row = next(line for line in out.splitlines() if line.lstrip("│ ").startswith("tiny"))
    return [c.strip() for c in row.split("│") if c.strip()]


def test_top_once_shows_a_busy_server(tiny_smol, capsys):
    app = build_app({"tiny": tiny_smol}, ServerSettings(api_key="k"))
    with running_server(app) as url:
        stop = threading.Event()

        def load(max_tokens: int) -> None:
            with httpx.Client(headers={"Authorization": "Bearer k"}, timeout=60) as c:
                while not stop.is_set():
                    c.post(f"{url}/v1/completions",
                           json={"prompt": "w5 w6", "max_tokens": max_tokens, "ignore_eos": True})  # fmt: skip

        # Lengths that differ, so that the four clients do not finish together
        # and leave the engine empty between their requests; even so `running`
        # is a gauge read at one instant (it can fall in a client's gap), so a
        # snapshot that shows none running is taken again, up to three times.
        threads = [threading.Thread(target=load, args=(48 + 16 * i,)) for i in range(4)]
        for t in threads:
            t.start()
        try:
            for _ in range(3):
                assert main(["top", url, "--once", "--interval", "1.5", "--api-key", "k"]) == 0
                out = capsys.readouterr().out
                cells = _tiny_row(out)
                if float(cells[1]) >= 1:
                    break
        finally:
            stop.set()
            for t in threads:
                t.join(60)
    assert "\x1b" not in out  # not a terminal: no control characters
    assert cells[0] == "tiny"
    running, gen_tps = float(cells[1]), float(cells[4])
    assert running >= 1 and gen_tps > 0, cells
    assert "RSS" in out and "MBU" in out
    wait_idle(tiny_smol)
