"""Percentiles and report formatting shared by the benchmarks."""

from __future__ import annotations

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


def rss_mib(pid: int) -> float:
    """Resident set size of a process (Linux /proc), MiB; NaN where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")
