"""`dsinfer probe`: measure this machine into a device profile (one device = one process with
one thread, as `--parallel` runs on CPU): memory bandwidth, GEMM per dtype, int8 kernel rate."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch


def _best(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def memory_bandwidth() -> float:
    """Bytes/s of a large copy (read + write), all threads: the node's bandwidth."""
    src = torch.ones(64 * 1024**2, dtype=torch.float32)  # 256 MiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src))


def gemm_flops(dtype: torch.dtype, n: int = 1024) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best(lambda: a @ b)


def int8_weight_rate() -> float:
    """Effective FLOP/s of the packed int8 weight kernel at one activation row (decode)."""
    n, k = 8192, 2048
    q = torch.randint(-127, 127, (n, k), dtype=torch.int8)
    s = torch.rand(n).bfloat16()
    x = torch.randn(1, k).bfloat16()
    return 2 * n * k / _best(lambda: torch._weight_int8pack_mm(x, q, s))


def probe(name: str = "this-cpu") -> dict[str, Any]:
    threads = torch.get_num_threads()
    bandwidth = memory_bandwidth()
    torch.set_num_threads(1)  # one device = one single-threaded process
    try:
        flops = {
            "float32": gemm_flops(torch.float32),
            "bfloat16": gemm_flops(torch.bfloat16),
            "int8": int8_weight_rate(),
        }
    finally:
        torch.set_num_threads(threads)
    cores = os.cpu_count() or 1
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # Ranks on one host talk through shared memory: as fast as a copy, ~20 µs per message
    # through gloo's TCP loopback (an assumption, not measured here).
    link = {"bandwidth": bandwidth / 2, "latency": 20e-6, "link": "gloo over loopback"}
    return {
        "name": name,
        "description": f"measured by dsinfer probe: {cores} cores, torch {torch.__version__}",
        "memory_bytes": ram,
        "memory_bandwidth": bandwidth,
        "flops": flops,
        "intra_node": link,
        "inter_node": {"bandwidth": 1.25e9, "latency": 50e-6, "link": "10 GbE (assumed)"},
        "devices_per_node": cores,
        "efficiency": {"compute": 0.8, "memory": 0.8, "link": 0.5},
        "shared_host": True,
        "sources": ["dsinfer probe (measured on this machine)"],
    }
