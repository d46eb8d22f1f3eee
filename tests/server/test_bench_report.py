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


def test_a_request_on_a_dead_keep_alive_connection_is_sent_again():
    """llama-server closes idle keep-alive connections; a request the load generator wrote onto
    one got no response at all and was counted as an error (4 of 64 in a run). It is now sent
    again and counted as retried; a server that answers badly is still an error."""
    import argparse
    import asyncio

    import httpx

    from dsinfer.bench.serve import one_request

    sse = (b'data: {"choices": [{"text": "hi"}]}\n\n'
           b'data: {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 2}}\n\n'
           b"data: [DONE]\n\n")  # fmt: skip
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(sse), sse))  # fmt: skip

    async def run(drop: int, status: int = 200) -> list:
        seen = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal seen
            await reader.readuntil(b"\r\n\r\n")
            seen += 1
            if seen <= drop:  # the connection dies with nothing sent
                writer.close()
                return
            writer.write(
                answer if status == 200 else b"HTTP/1.1 500 x\r\ncontent-length: 0\r\n\r\n"
            )
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        args = argparse.Namespace(output_len=4, temperature=0.0, top_p=1.0, model=None,
                                  api_key=None, url=f"http://127.0.0.1:{port}")  # fmt: skip
        async with server, httpx.AsyncClient() as client:
            res = await one_request(client, args, "hello")
        return [res, seen]

    res, seen = asyncio.run(run(drop=1))
    assert res.ok and res.retried and res.output_tokens == 1 and seen == 2
    res, seen = asyncio.run(run(drop=0))
    assert res.ok and not res.retried and seen == 1
    res, seen = asyncio.run(run(drop=5))  # a server that never answers: an error, not a loop
    assert not res.ok and seen == 3
    res, seen = asyncio.run(run(drop=0, status=500))
    assert not res.ok and not res.retried and "HTTP 500" in res.error and seen == 1
