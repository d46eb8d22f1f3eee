"""`dsinfer probe`: measure this machine into a device profile (one device = one process with
one thread, as `--parallel` runs on CPU): memory bandwidth, GEMM per dtype, int8 kernel rate."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from dsinfer.device.host_memory import copy_buffers
from dsinfer.planner.dispatch_probe import expert_overhead, layer_overhead
from dsinfer.progress import progress


def _best(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def memory_bandwidth() -> float:
    """Bytes/s of a large copy (read + write), all threads: the node's bandwidth, in the huge
    pages the engine keeps its weights and KV pool in (device/host_memory.copy_buffers)."""
    src, dst = copy_buffers(256 << 20)
    return 2 * src.nbytes / _best(lambda: dst.copy_(src))


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


def _link_rank(rank: int, port: int, result: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # Both processes stream memory at once: what one device gets when its neighbour is busy
    # too (each --parallel rank reads its own weights at the same time).
    dist.barrier()
    concurrent = torch.tensor([memory_bandwidth()])
    dist.all_reduce(concurrent, op=dist.ReduceOp.MIN)
    small, big = torch.ones(1536), torch.ones(4 * 1024**2)  # one token's hidden; 16 MiB
    for _ in range(20):
        dist.all_reduce(small)
    t = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(small)
    idle = (time.perf_counter() - t) / 200 / 2  # a 2-rank all-reduce is ~2 messages
    # In a decode step each all-reduce follows a matmul, and the faster rank waits for the
    # slower one: time matmul+all-reduce against matmul alone (what a step really pays).
    weights = [torch.randn(1536, 1536, dtype=torch.bfloat16) for _ in range(16)]
    x = torch.randn(1, 1536, dtype=torch.bfloat16)

    def layers(sync: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(128):
            torch.nn.functional.linear(x, weights[i % 16])
            if sync:
                dist.all_reduce(small)
        return time.perf_counter() - t0

    layers(True)
    alone = min(layers(False) for _ in range(3))
    synced = min(layers(True) for _ in range(3))
    latency = max(idle, (synced - alone) / 128 / 2)
    t = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(big)
    bandwidth = big.numel() * 4 / ((time.perf_counter() - t) / 5)  # 2(n-1)/n = 1 for n = 2
    if rank == 0:
        result.put((latency, bandwidth, float(concurrent), idle))
    dist.destroy_process_group()


def link_between_processes() -> tuple[float, float, float, float]:
    """Gloo between two single-threaded local processes: (latency per message inside a step,
    bytes/s, the memory bandwidth each reaches while both stream at once, idle latency)."""
    import multiprocessing as mp

    from dsinfer.distributed.parallel_state import free_local_port

    port = free_local_port()
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=_link_rank, args=(r, port, result)) for r in (0, 1)]
    for p in procs:
        p.start()
    measured = result.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    return measured


def probe(name: str = "this-cpu") -> dict[str, Any]:
    threads = torch.get_num_threads()
    with progress("probing this machine", 8) as step:
        bandwidth = memory_bandwidth()
        step(1)
        torch.set_num_threads(1)  # one device = one single-threaded process
        try:
            # One thread cannot saturate the memory system: a device's own ceiling.
            device_bandwidth = memory_bandwidth()
            step(1)
            flops = {}
            for key, measure in (
                ("float32", lambda: gemm_flops(torch.float32)),
                ("bfloat16", lambda: gemm_flops(torch.bfloat16)),
                ("int8", int8_weight_rate),
            ):
                flops[key] = measure()
                step(1)
            per_layer = layer_overhead()
            step(1)
            per_expert = expert_overhead()
            step(1)
        finally:
            torch.set_num_threads(threads)
        latency, link_bw, concurrent, idle = link_between_processes()
        step(1)
    cores = os.cpu_count() or 1
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link = {
        "bandwidth": link_bw,
        "latency": latency,
        "latency_idle": idle,
        "link": "gloo over loopback (measured; latency as paid between matmuls)",
    }
    return {
        "name": name,
        "description": f"measured by dsinfer probe: {cores} cores, torch {torch.__version__}",
        "memory_bytes": ram,
        "memory_bandwidth": bandwidth,
        "device_bandwidth": device_bandwidth,
        "concurrent_bandwidth": concurrent,
        "layer_overhead": per_layer,
        "expert_overhead": per_expert,
        "flops": flops,
        "intra_node": link,
        "inter_node": {"bandwidth": 1.25e9, "latency": 50e-6, "link": "10 GbE (assumed)"},
        "devices_per_node": cores,
        "efficiency": {"compute": 0.8, "memory": 0.8, "link": 0.5},
        "shared_host": True,
        "sources": ["dsinfer probe (measured on this machine)"],
    }
