"""Soak: hours of constant streaming load on a real `dsinfer serve`, with the faults a server
meets — clients that leave mid-stream, malformed requests, hot swaps — and a record per minute.

    python benchmarks/soak.py --minutes 120 --out soak/            # the published two-hour run
    python benchmarks/soak.py --minutes 3 --swap-every 1 --out s/  # a quick look

Load: `--clients` (16) streaming clients in a closed loop, each request a short (~20 token) or a
long (~300 token) prompt at random and 48 new tokens (`ignore_eos`, so E2E measures the engine,
not the text); 5% of streams are dropped by the client after a few chunks; 1% of requests are
malformed (each must get a 4xx). Every `--swap-every` minutes the model is hot-swapped between
two compiled artifacts (SmolLM2 int4 with groups of 32 and of 64, unless --artifacts; load →
promote → unload the old) through the admin API.

Per minute: p50/p99 TTFT and E2E of well-formed completed requests (short and long prompts
apart), failures, server RSS and KV blocks in use. At the end, with the load stopped: KV blocks
in use (leaks) and /health. Writes soak.json, soak.md (the table) and soak.png into --out, and
exits 1 when a target is missed: 0 failed well-formed requests, p99/p50 E2E ≤ 1.3 in every
10-minute window (per prompt class), RSS growth ≤ 5% after the first 10 minutes, 0 leaked blocks.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from dsinfer.bench.stats import percentile, rss_mib, wait_healthy

ADMIN = "soak-admin"
SHORT = "Write one sentence about the sea."
LONG = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(24))
MALFORMED = [
    b'{"prompt": "a", "max_tokens": -4}',
    b'{"prompt": "a\\ud800"}',
    b'{"prompt": "a", "seed": 18446744073709551616}',
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt": "a", "temperature": NaN}',
    b"not json at all",
    b'{"messages": "x"}',
]


@dataclass
class Sample:
    start: float  # seconds since the soak began
    kind: str  # short | long | dropped | malformed
    status: int
    ttft: float | None
    e2e: float | None
    error: str | None = None


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Client(threading.Thread):
    def __init__(self, url: str, t0: float, stop: threading.Event, out: list[Sample], seed: int):
        super().__init__(daemon=True)
        self.url, self.t0, self.stop, self.out = url, t0, stop, out
        self.rng = random.Random(seed)

    def run(self) -> None:
        with httpx.Client(timeout=300) as http:
            while not self.stop.is_set():
                roll = self.rng.random()
                if roll < 0.01:
                    self.out.append(self.malformed(http))
                else:
                    self.out.append(self.stream(http, drop=roll < 0.06))

    def malformed(self, http: httpx.Client) -> Sample:
        start = time.monotonic()
        body = self.rng.choice(MALFORMED)
        r = http.post(
            f"{self.url}/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        ok = 400 <= r.status_code < 500
        return Sample(
            start - self.t0, "malformed", r.status_code, None, None, None if ok else r.text
        )

    def stream(self, http: httpx.Client, drop: bool) -> Sample:
        kind = "long" if self.rng.random() < 0.3 else "short"
        body = {
            "model": "smol",
            "prompt": LONG if kind == "long" else SHORT,
            "max_tokens": 48,
            "ignore_eos": True,
            "temperature": 0.7,
            "stream": True,
        }
        start = time.monotonic()
        ttft, chunks, error, status = None, 0, None, 0
        try:
            with http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                        break
                    if ttft is None:
                        ttft = time.monotonic() - start
                    chunks += 1
                    if drop and chunks == 3:
                        break  # the client leaves mid-stream
                if status != 200:
                    error = r.read().decode()[:200]
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {e}"
        e2e = time.monotonic() - start
        if drop and error is None:
            return Sample(start - self.t0, "dropped", status, ttft, None)
        return Sample(start - self.t0, kind, status, ttft, e2e, error)


def swap(url: str, paths: list[str], current: int) -> int:
    """Load the other artifact, send it all traffic, unload the old one."""
    h = {"Authorization": f"Bearer {ADMIN}"}
    nxt = 1 - current
    label = f"v{int(time.time())}"
    r = httpx.post(
        f"{url}/admin/models/smol/versions",
        json={"path": paths[nxt], "label": label},
        headers=h,
        timeout=600,
    )
    r.raise_for_status()
    httpx.post(
        f"{url}/admin/models/smol/promote", json={"version": label}, headers=h, timeout=60
    ).raise_for_status()
    models = httpx.get(f"{url}/admin/models", headers=h, timeout=60).json()["models"]
    for v in models[0]["versions"]:
        if v["label"] != label:
            httpx.delete(
                f"{url}/admin/models/smol/versions/{v['version']}", headers=h, timeout=600
            ).raise_for_status()
    return nxt


def summarise(samples: list[Sample], per_min: list[dict], minutes: float) -> dict:
    ok = [s for s in samples if s.kind in ("short", "long") and s.error is None]
    failed = [s for s in samples if s.kind in ("short", "long", "dropped") and s.error]
    bad_malformed = [s for s in samples if s.kind == "malformed" and s.error]
    windows = []
    for w0 in range(0, max(1, int(minutes)), 10):
        row = {"window": f"{w0}-{min(w0 + 10, minutes):g} min"}
        for kind in ("short", "long"):
            xs = [s.e2e for s in ok if s.kind == kind and w0 * 60 <= s.start < (w0 + 10) * 60]
            if xs:
                p50, p99 = statistics.median(xs), percentile(xs, 99)
                row[kind] = {"n": len(xs), "p50": p50, "p99": p99, "ratio": p99 / p50}
        windows.append(row)
    rss = [m["rss_mib"] for m in per_min]
    settled = rss[min(10, len(rss) - 1)] if rss else float("nan")
    growth = (max(rss[10:]) / settled - 1) if len(rss) > 11 else None
    return {
        "requests": len(samples),
        "well_formed_ok": len(ok),
        "well_formed_failed": len(failed),
        "failures": [asdict(s) for s in failed[:20]],
        "malformed": sum(s.kind == "malformed" for s in samples),
        "malformed_not_4xx": len(bad_malformed),
        "dropped": sum(s.kind == "dropped" for s in samples),
        "windows": windows,
        "rss_growth_after_10min": growth,
    }


def plot(per_min: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return False
    t = [m["minute"] for m in per_min]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for key, style in (("e2e_p50", "-"), ("e2e_p99", "--"), ("ttft_p50", "-"), ("ttft_p99", "--")):
        a.plot(t, [m[key] for m in per_min], style, label=key.replace("_", " "))
    for m in per_min:
        if m.get("swap"):
            a.axvline(m["minute"], color="grey", alpha=0.3)
    a.set_ylabel("seconds (short prompts)")
    a.legend(loc="upper right", fontsize=8)
    b.plot(t, [m["rss_mib"] for m in per_min], label="server RSS (MiB)")
    b.set_ylabel("MiB")
    b.set_xlabel("minute (grey lines: hot swaps)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=120)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--swap-every", type=float, default=10, help="minutes between hot swaps")
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--out", default="soak")
    p.add_argument("--artifacts", nargs=2, default=None, help="two compiled artifacts")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.artifacts:
        paths = list(args.artifacts)
    else:
        # Two versions of one scheme (int4, groups of 32 and of 64): they run at about the same
        # speed, so a window's latency spread shows the swap, not a faster or slower version.
        work = Path(tempfile.mkdtemp(prefix="dsinfer-soak-"))
        paths = [str(work / "int4-g32"), str(work / "int4-g64")]
        for path, group in zip(paths, ("32", "64"), strict=True):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "dsinfer.cli",
                    "compile",
                    "smollm2",
                    "-o",
                    path,
                    "--quant",
                    "int4",
                    "--group-size",
                    group,
                ],
                check=True,
                capture_output=True,
            )
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsinfer.cli",
            "serve",
            "--model",
            f"smol={paths[0]}",
            "--port",
            str(args.port),
            "--admin-api-key",
            ADMIN,
            "--allow-unsigned",
        ],
        stdout=open(out / "server.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    try:
        wait_healthy(url, server, timeout=600)
        samples: list[Sample] = []
        stop = threading.Event()
        t0 = time.monotonic()
        clients = [Client(url, t0, stop, samples, seed=i) for i in range(args.clients)]
        for c in clients:
            c.start()
        per_min: list[dict] = []
        current, next_swap = 0, args.swap_every
        for minute in range(1, int(args.minutes) + 1):
            time.sleep(max(0.0, t0 + 60 * minute - time.monotonic()))
            done = [s for s in samples if (minute - 1) * 60 <= s.start < minute * 60]
            short = [s for s in done if s.kind == "short" and s.error is None]
            row = {
                "minute": minute,
                "requests": len(done),
                "errors": sum(1 for s in done if s.error and s.kind != "malformed"),
                "e2e_p50": statistics.median([s.e2e for s in short]) if short else None,
                "e2e_p99": percentile([s.e2e for s in short], 99) if short else None,
                "ttft_p50": statistics.median([s.ttft for s in short]) if short else None,
                "ttft_p99": percentile([s.ttft for s in short], 99) if short else None,
                "rss_mib": rss_mib(server.pid),
                "kv_blocks_used": metric(url, "dsinfer:kv_blocks_used"),
            }
            if minute >= next_swap and minute < args.minutes:
                current = swap(url, paths, current)
                row["swap"] = True
                next_swap += args.swap_every
            per_min.append(row)
            print(json.dumps(row), flush=True)
        stop.set()
        for c in clients:
            c.join(timeout=600)
        time.sleep(2)
        leaked = metric(url, "dsinfer:kv_blocks_used")
        health = httpx.get(f"{url}/health", timeout=30).json()
    finally:
        server.terminate()
        server.wait(timeout=60)
    summary = summarise(samples, per_min, args.minutes)
    summary |= {"leaked_blocks": leaked, "health": health, "per_minute": per_min}
    (out / "soak.json").write_text(json.dumps(summary, indent=2))
    plot(per_min, out / "soak.png")
    checks = {
        "0 failed well-formed requests": summary["well_formed_failed"] == 0,
        "malformed requests all 4xx": summary["malformed_not_4xx"] == 0,
        "p99/p50 E2E <= 1.3 in every 10-min window": all(
            w[k]["ratio"] <= 1.3 for w in summary["windows"] for k in ("short", "long") if k in w
        ),
        "RSS growth <= 5% after 10 min": (summary["rss_growth_after_10min"] or 0) <= 0.05,
        "0 leaked KV blocks": leaked == 0,
    }
    lines = [
        "| window | short n | short p50 / p99 E2E (ratio) | long n | long p50 / p99 (ratio) |",
        "|---|---|---|---|---|",
    ]
    for w in summary["windows"]:
        cells = [w["window"]]
        for k in ("short", "long"):
            c = w.get(k)
            cells += (
                [str(c["n"]), f"{c['p50']:.2f} / {c['p99']:.2f} s ({c['ratio']:.2f})"]
                if c
                else ["0", "-"]
            )
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in checks.items())]
    lines.append(
        f"- requests {summary['requests']}: {summary['well_formed_ok']} completed, "
        f"{summary['dropped']} dropped by the client, {summary['malformed']} malformed, "
        f"{summary['well_formed_failed']} failed; RSS growth after 10 min: "
        f"{summary['rss_growth_after_10min']}; leaked blocks {leaked}"
    )
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
