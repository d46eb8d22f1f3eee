"""`dsinfer top [URL…]`: a live view of running servers, from their /metrics alone.

Per model@version: requests running and waiting, prompt and generation tokens/s, TTFT and
inter-token p50/p99 over the last minute, KV pool use, prefix-cache hit rate, preemptions, MTP
acceptance, MBU/MFU; per server: resident memory and CPU. Rates and percentiles come from the
difference between two scrapes (the oldest kept, up to a minute back), so `--once` scrapes twice,
`--interval` apart. Works against any dsinfer server the user can reach (`--api-key` for one
whose /metrics needs the key).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections import deque
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

P = "dsinfer:"
WINDOW_S = 60.0


@dataclass
class Scrape:
    at: float
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def values(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {labels: v for (n, labels), v in self.samples.items() if n == name}

    def by_model(self, name: str) -> dict[str, float]:
        """model@version (or model) → the summed value of `name`'s samples."""
        out: dict[str, float] = {}
        for labels, v in self.values(name).items():
            key = _model_key(dict(labels))
            if key is not None:
                out[key] = out.get(key, 0.0) + v
        return out

    def buckets(self, name: str) -> dict[str, list[tuple[float, float]]]:
        """model → [(le, cumulative count)] of a histogram."""
        out: dict[str, list[tuple[float, float]]] = {}
        for labels, v in self.values(f"{name}_bucket").items():
            d = dict(labels)
            key = _model_key(d)
            if key is not None:
                out.setdefault(key, []).append((float(d["le"]), v))
        return {k: sorted(b) for k, b in out.items()}


def _model_key(labels: dict[str, str]) -> str | None:
    name = labels.get("model_name")
    if name is None:
        return None
    return f"{name}@{labels['version']}" if labels.get("version") else name


def scrape(client: httpx.Client, url: str) -> Scrape:
    text = client.get(f"{url}/metrics").raise_for_status().text
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return Scrape(time.monotonic(), samples)


def quantile(now: list[tuple[float, float]], before: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of the observations between two scrapes of a histogram (linear inside
    the bucket, as PromQL's histogram_quantile); NaN when there were none."""
    prev = dict(before)
    counts = [(le, c - prev.get(le, 0.0)) for le, c in now]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return math.nan
    rank, lo, below = q * total, 0.0, 0.0
    for le, c in counts:
        if c >= rank:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * (rank - below) / max(c - below, 1e-12)
        lo, below = le, c
    return lo


@dataclass
class Row:
    model: str
    running: float
    waiting: float
    prompt_tps: float
    gen_tps: float
    ttft: tuple[float, float]
    itl: tuple[float, float]
    kv: float
    hit_rate: float
    preemptions: float
    acceptance: float
    mbu: float
    mfu: float


def rows(now: Scrape, before: Scrape) -> list[Row]:
    dt = max(now.at - before.at, 1e-9)

    def rate(name: str, model: str) -> float:
        a, b = now.by_model(name).get(model, 0.0), before.by_model(name).get(model, 0.0)
        return max(0.0, a - b) / dt

    def delta(name: str, model: str) -> float:
        return max(0.0, now.by_model(name).get(model, 0.0) - before.by_model(name).get(model, 0.0))

    def pct(hist: str, model: str) -> tuple[float, float]:
        a, b = now.buckets(hist).get(model, []), before.buckets(hist).get(model, [])
        return quantile(a, b, 0.5), quantile(a, b, 0.99)

    out = []
    for model in sorted(now.by_model(f"{P}num_requests_running")):
        queries = delta(f"{P}prefix_cache_queries_total", model)
        drafts = delta(f"{P}spec_decode_num_draft_tokens_total", model)
        g = now.by_model
        out.append(
            Row(
                model=model,
                running=g(f"{P}num_requests_running")[model],
                waiting=g(f"{P}num_requests_waiting").get(model, 0.0),
                prompt_tps=rate(f"{P}prompt_tokens_total", model),
                gen_tps=rate(f"{P}generation_tokens_total", model),
                ttft=pct(f"{P}time_to_first_token_seconds", model),
                itl=pct(f"{P}inter_token_latency_seconds", model),
                kv=g(f"{P}kv_cache_usage_perc").get(model, 0.0),
                hit_rate=delta(f"{P}prefix_cache_hits_total", model) / queries if queries else 0,
                preemptions=g(f"{P}num_preemptions_total").get(model, 0.0),
                acceptance=(
                    delta(f"{P}spec_decode_num_accepted_tokens_total", model) / drafts
                    if drafts
                    else math.nan
                ),
                mbu=g(f"{P}memory_bandwidth_utilization").get(model, 0.0),
                mfu=g(f"{P}flops_utilization").get(model, 0.0),
            )
        )
    return out


def _ms(pair: tuple[float, float]) -> str:
    return "/".join("–" if math.isnan(v) else f"{1e3 * v:.0f}" for v in pair)


def render(url: str, now: Scrape, before: Scrape):  # noqa: ANN201 (a rich renderable)
    from rich.table import Table

    rss = sum(now.values("process_resident_memory_bytes").values())
    cpu = sum(now.values("process_cpu_seconds_total").values()) - sum(
        before.values("process_cpu_seconds_total").values()
    )
    span = max(now.at - before.at, 1e-9)
    table = Table(
        title=f"{url}  RSS {rss / 2**20:,.0f} MiB  CPU {100 * cpu / span:.0f}%  "
        f"(rates over {span:.0f} s)",
        title_justify="left",
    )
    for col in ("model", "run", "wait", "prompt tok/s", "gen tok/s", "TTFT p50/p99 ms",
                "ITL p50/p99 ms", "KV", "prefix hit", "preempt", "MTP acc", "MBU", "MFU"):  # fmt: skip
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows(now, before):
        table.add_row(
            r.model, f"{r.running:.0f}", f"{r.waiting:.0f}", f"{r.prompt_tps:.1f}",
            f"{r.gen_tps:.1f}", _ms(r.ttft), _ms(r.itl), f"{100 * r.kv:.0f}%",
            f"{100 * r.hit_rate:.0f}%", f"{r.preemptions:.0f}",
            "–" if math.isnan(r.acceptance) else f"{100 * r.acceptance:.0f}%",
            f"{100 * r.mbu:.1f}%", f"{100 * r.mfu:.1f}%",
        )  # fmt: skip
    return table


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("top", help="a live view of dsinfer servers (reads /metrics)")
    t.add_argument("urls", nargs="*", default=["http://127.0.0.1:8000"], metavar="URL")
    t.add_argument("--once", action="store_true", help="print one frame and exit (scripts)")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    t.add_argument("--api-key", default=None, help="for servers whose /metrics needs the key")
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console, Group
    from rich.live import Live

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per scrape is noise here
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    urls = [u.rstrip("/") for u in args.urls]
    # A pipe or a log gets the whole table (no terminal width to fit), without colours.
    console = Console() if sys.stdout.isatty() else Console(width=200, no_color=True)
    with httpx.Client(headers=headers, timeout=10) as client:
        try:
            history = {u: deque([scrape(client, u)]) for u in urls}
        except httpx.HTTPError as e:
            raise ValueError(f"cannot read metrics: {e}") from None

        def frame():  # noqa: ANN202
            parts = []
            for u in urls:
                h = history[u]
                h.append(scrape(client, u))
                while len(h) > 2 and h[-1].at - h[1].at >= WINDOW_S:
                    h.popleft()  # keep a minute of scrapes: rates and percentiles over it
                parts.append(render(u, h[-1], h[0]))
            return Group(*parts)

        time.sleep(args.interval)
        if args.once:
            console.print(frame())
            return 0
        with Live(frame(), console=console, refresh_per_second=4) as live:
            try:
                while True:
                    time.sleep(args.interval)
                    live.update(frame())
            except KeyboardInterrupt:
                return 0
