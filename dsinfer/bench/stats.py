"""Percentiles, process memory and server start-up shared by the benchmarks."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no data."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(values: list[float]) -> dict[str, float]:
    return {
        "mean": sum(values) / len(values) if values else float("nan"),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
    }


def best_seconds(fn: Callable[[], object], calls: int, rounds: int, warmup: int = 1) -> float:
    """Seconds per call of fn: the fastest of `rounds` rounds of `calls` calls, after `warmup`
    calls (these machines are noisy; the best round is the least disturbed one)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _status_mib(pid: int, field: str) -> float:
    """A kB field of /proc/PID/status in MiB; NaN where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def rss_mib(pid: int) -> float:
    """Resident set size of a process now (Linux /proc), MiB."""
    return _status_mib(pid, "VmRSS")


def peak_rss_mib(pid: int) -> float:
    """The highest resident set size the process has had (VmHWM), MiB."""
    return _status_mib(pid, "VmHWM")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> float:
    """Poll `url`/health until it answers 200; seconds it took. Raises if the server process
    exits first or `timeout` passes (a benchmark against a dead server measures nothing)."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout}s")
