"""Hot-swap benchmark: time from `dsinfer compile` start to the new version serving 100% of
traffic, the p99 latency of other traffic during the swap vs before it, and the server's RSS
before, during and after (the unloaded version's memory returned).

    python benchmarks/hot_swap.py [--v1 ART] [--clients 4] [--phase-seconds 30]

Starts `dsinfer serve` with SmolLM2 v1 (a bf16 artifact, compiled first if not given), keeps
`--clients` streaming clients busy, then: compile v2 (int8) → deploy load → promote → unload v1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from dsinfer.bench.stats import percentile, rss_mib, wait_healthy

ADMIN = "bench-admin"


def dsinfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsinfer.cli", *args], capture_output=True, text=True, check=True
    )


class Load:
    def __init__(self, url: str, clients: int) -> None:
        self.url, self.stop = url, threading.Event()
        self.samples: list[tuple[float, float, str]] = []  # (end time, latency, model)
        self.errors = 0
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def run(self) -> None:
        body = {"model": "smol", "prompt": "The history of the bicycle", "max_tokens": 32}
        while not self.stop.is_set():
            t = time.perf_counter()
            try:
                r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
                r.raise_for_status()
                self.samples.append(
                    (time.perf_counter(), time.perf_counter() - t, r.json()["model"])
                )
            except httpx.HTTPError:
                self.errors += 1

    def window(self, t0: float, t1: float) -> list[float]:
        """Latencies of requests that were in flight at any time in [t0, t1]."""
        return [lat for end, lat, _m in self.samples if end >= t0 and end - lat <= t1]


def admin(url: str, method: str, path: str, json: object = None) -> dict:
    r = httpx.request(
        method,
        f"{url}/admin{path}",
        json=json,
        timeout=600,
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    r.raise_for_status()
    return r.json()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--v1", default=None)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--phase-seconds", type=float, default=30)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--nice", action="store_true", help="compile at nice 19 on one thread")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dsinfer-swap-"))
    v1 = args.v1 or str(work / "v1")
    if args.v1 is None:
        dsinfer("compile", "smollm2", "-o", v1, "--quant", "bf16")
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsinfer.cli",
            "serve",
            "--model",
            f"smol={v1}",
            "--port",
            str(args.port),
            "--admin-api-key",
            ADMIN,
            "--allow-unsigned",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(url, server, timeout=600)
        rss_one = rss_mib(server.pid)
        load = Load(url, args.clients)
        for t in load.threads:
            t.start()
        t_before = time.perf_counter()
        time.sleep(args.phase_seconds)
        t_swap = time.perf_counter()
        # The compile runs at low priority on one thread, as an operator would run it beside a
        # serving process on a small machine.
        subprocess.run(
            [
                "nice",
                "-n",
                "19",
                sys.executable,
                "-m",
                "dsinfer.cli",
                "compile",
                "smollm2",
                "-o",
                str(work / "v2"),
                "--quant",
                "int8",
            ],
            capture_output=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        t_compiled = time.perf_counter()
        loaded = admin(
            url, "POST", "/models/smol/versions", {"path": str(work / "v2"), "label": "v2"}
        )
        rss_two = rss_mib(server.pid)
        admin(url, "POST", "/models/smol/promote", {"version": "v2"})
        t_full = time.perf_counter()
        v1_id = next(
            v["version"]
            for v in admin(url, "GET", "/models")["models"][0]["versions"]
            if v["label"] != "v2"
        )
        admin(url, "DELETE", f"/models/smol/versions/{v1_id}")
        rss_after = rss_mib(server.pid)
        time.sleep(args.phase_seconds / 3)
        load.stop.set()
        for t in load.threads:
            t.join()
        before = load.window(t_before, t_swap)
        compiling, during = load.window(t_swap, t_compiled), load.window(t_compiled, t_full)
        print(
            f"compile start → {loaded['model']} at 100%: {t_full - t_swap:.1f} s "
            f"(compile {t_compiled - t_swap:.1f} s, load+warm+promote {t_full - t_compiled:.1f} s)"
        )
        print(
            f"latency before swap: n={len(before)} p50 {statistics.median(before):.2f} s "
            f"p99 {percentile(before, 99):.2f} s"
        )
        for label, xs in (("during compile", compiling), ("during load/warm/promote", during)):
            ratio = percentile(xs, 99) / percentile(before, 99)
            print(
                f"latency {label}: n={len(xs)} p50 {statistics.median(xs):.2f} s "
                f"p99 {percentile(xs, 99):.2f} s (×{ratio:.2f} the p99 before)"
            )
        print(
            f"server RSS: v1 {rss_one:.0f} MiB, v1+v2 {rss_two:.0f} MiB, after unloading v1 "
            f"{rss_after:.0f} MiB; failed requests {load.errors} of {len(load.samples) + load.errors}"
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
