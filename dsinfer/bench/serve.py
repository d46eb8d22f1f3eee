"""`dsinfer bench serve`: a bounded streaming load against any OpenAI-compatible server.

Loopback only unless --allow-remote: this is a load generator, and load goes where we own it.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from dsinfer.bench.stats import summarize
from dsinfer.progress import progress

WORDS = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city"
).split()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--concurrency",
        default="1",
        help="concurrent streams; a comma list (1,4,16) runs a sweep, one level after another",
    )
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="run for this many seconds at constant concurrency instead",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (≈tokens)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (0: greedy, the default)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus of every request (1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="OUT", help="write the report as JSON")
    p.add_argument("--allow-remote", action="store_true")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write serve.json, report.md and plots (throughput, latency, distribution)",
    )
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="URL",
        help="run the same load against another OpenAI-compatible server (llama-server, "
        "vLLM) in the same run, one after the other (repeatable)",
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        help="names of --url then each --compare in the report (default: the URLs)",
    )


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    unsent: bool = False  # failed before any response: a dead keep-alive connection
    retried: bool = False


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"{url} is not a loopback address; pass --allow-remote to load it")


async def one_request(client, args: argparse.Namespace, prompt: str) -> Result:  # noqa: ANN001
    body = {
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if args.model:
        body["model"] = args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    res = await _stream_once(client, args, body, headers)
    for _ in range(2):
        if not res.unsent:
            break
        # A pooled keep-alive connection the server had already closed (llama-server closes
        # idle ones): nothing came back, so it is sent again, as HTTP clients do (the openai
        # client retries these too); the pool drops the dead connection. Counted.
        res = await _stream_once(client, args, body, headers)
        res.retried = True
    return res


async def _stream_once(client, args: argparse.Namespace, body: dict, headers: dict) -> Result:  # noqa: ANN001
    import httpx

    t0 = time.perf_counter()
    res = Result(ok=False)
    last = None
    chunks = 0
    try:
        async with client.stream(
            "POST", f"{args.url}/v1/completions", json=body, headers=headers
        ) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
                    res.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                if obj.get("choices") and obj["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
                    chunks += 1
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = True
    except Exception as e:  # noqa: BLE001  (a failed request is data, not a crash)
        res.error = repr(e)
        # Nothing came back at all: the connection was dead before the server read it.
        res.unsent = isinstance(e, httpx.RemoteProtocolError) and last is None and not res.ttft
    return res


async def run_load(args: argparse.Namespace) -> tuple[list[Result], float]:
    import httpx

    rng = random.Random(args.seed)
    results: list[Result] = []
    issued = 0
    stop_at = time.perf_counter() + args.duration if args.duration else None

    def more() -> bool:
        if stop_at is not None:
            return time.perf_counter() < stop_at
        return issued < args.num_requests

    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=args.concurrency + 4)
    ) as c:
        # Progress in requests (or seconds with --duration): a bar on a terminal, log lines
        # otherwise.
        total = args.duration or args.num_requests
        with progress(f"load at concurrency {args.concurrency}", total) as advance:

            async def worker() -> None:
                nonlocal issued
                while more():
                    issued += 1
                    prompt = " ".join(rng.choice(WORDS) for _ in range(args.input_len))
                    result = await one_request(c, args, prompt)
                    results.append(result)
                    advance(result.e2e / args.concurrency if args.duration else 1)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return results, time.perf_counter() - t0


def report(results: list[Result], wall: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    rep = {
        "url": args.url,
        "concurrency": args.concurrency,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "retried": sum(r.retried for r in results),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "wall_s": wall,
        "request_throughput": len(ok) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "ttft_s": summarize([r.ttft for r in ok]),
        "itl_s": summarize([x for r in ok for x in r.itls]),
        "e2e_s": summarize([r.e2e for r in ok]),
        "e2e_samples_s": [round(r.e2e, 4) for r in ok],
        "first_errors": [r.error for r in results if not r.ok][:3],
    }
    e2e = rep["e2e_s"]
    rep["e2e_p99_over_p50"] = e2e["p99"] / e2e["p50"] if ok else float("nan")
    return rep


def print_report(rep: dict) -> None:
    print(
        f"url {rep['url']}  concurrency {rep['concurrency']}  requests {rep['requests']}  "
        f"errors {rep['errors']}  retried {rep.get('retried', 0)}  wall {rep['wall_s']:.1f}s"
    )
    print(
        f"throughput: {rep['request_throughput']:.2f} req/s, "
        f"{rep['output_tokens_per_s']:.1f} output tok/s"
    )
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        s = rep[key]
        print(
            f"{label:5s} ms  p50 {1e3 * s['p50']:8.1f}  p95 {1e3 * s['p95']:8.1f}  "
            f"p99 {1e3 * s['p99']:8.1f}"
        )
    print(f"E2E p99/p50: {rep['e2e_p99_over_p50']:.2f}")
    for e in rep["first_errors"]:
        print(f"error: {e}")


def concurrency_levels(spec: str | int) -> list[int]:
    try:
        levels = [int(x) for x in str(spec).split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--concurrency {spec!r}: write a number or a list such as 1,4,16"
        ) from None
    if not levels or min(levels) < 1:
        raise ValueError("--concurrency levels must be >= 1")
    return levels


def run_cli(args: argparse.Namespace) -> int:
    levels = concurrency_levels(args.concurrency)
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if args.duration is not None and not 0 < args.duration <= 4 * 3600:
        raise ValueError("--duration must be between 0 and 14400 seconds")
    urls = [args.url, *args.compare]
    labels = args.label or urls
    if len(labels) != len(urls):
        raise ValueError(f"{len(labels)} --label for {len(urls)} servers (--url and --compare)")
    if not args.allow_remote:
        for url in urls:
            check_loopback(url)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here
    series: dict[str, list[dict]] = {}
    failed = False
    for url, label in zip(urls, labels, strict=True):
        for level in levels:
            run = argparse.Namespace(**{**vars(args), "url": url, "concurrency": level})
            results, wall = asyncio.run(run_load(run))
            rep = report(results, wall, run)
            print_report(rep)
            series.setdefault(label, []).append(rep)
            failed = failed or rep["errors"] > 0
    if args.json:
        only = series[labels[0]]
        with open(args.json, "w") as f:
            json.dump(only[0] if len(only) == 1 and len(urls) == 1 else series, f, indent=2)
    if args.out:
        from pathlib import Path

        from dsinfer.bench.report import write_serve_report

        for path in write_serve_report(series, Path(args.out)):
            print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_args(p)
    sys.exit(run_cli(p.parse_args()))
