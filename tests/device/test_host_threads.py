"""The serving process's OpenMP pools (device/host_threads.py): libgomp keeps one pool of
worker threads per thread that has run a parallel region, and with more such threads than CPUs
it stops spinning between regions, so every region of the engine thread pays a futex wake-up
(a decode step 1.4 → 6.3 ms at one row, measured). These tests count the process's threads in
fresh interpreters: a pool's worker threads appear in /proc/self/task."""

from __future__ import annotations

from tests.helpers import run_fresh_python

# Prepended to every probe: the process's thread count, and that count once threads that are
# exiting have gone (a released pool's workers leave asynchronously; at most 5 s).
_COUNT = """
import os, time
def threads():
    return len(os.listdir('/proc/self/task'))
def settled(n):
    deadline = time.monotonic() + 5
    while threads() > n and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()
"""


def test_importing_dsinfer_starts_no_openmp_pool() -> None:
    """No module runs a parallel torch op at import: the importing thread (the server's main
    thread) stays without a pool. A module-level `torch.ones(128, 128).triu_()` did start
    one, and the server's decode steps ran at a third of their speed."""
    out = run_fresh_python(
        _COUNT
        + """
import torch
torch.set_num_threads(2)
before = threads()
import dsinfer, dsinfer.cli, dsinfer.server.api, dsinfer.models.registry
import dsinfer.layers.attention.fused_cpu, dsinfer.layers.quant, dsinfer.worker.model_runner
print(before, threads())
"""
    )
    before, after = out.split()
    assert after == before, f"importing dsinfer started {int(after) - int(before)} thread(s)"


def test_a_released_pool_lets_its_worker_threads_go() -> None:
    """A thread that has run a 2-thread region holds a worker; release_openmp_pool lets it go
    (the next region starts a new one)."""
    out = run_fresh_python(
        _COUNT
        + """
import torch
from dsinfer.device.host_threads import release_openmp_pool
torch.set_num_threads(2)
before = threads()
a = torch.randn(400_000)
torch.add(a, a)  # a parallel region: the pool's worker starts
during = threads()
released = release_openmp_pool()
after = settled(before)
torch.add(a, a)
print(before, during, released, after, threads())
"""
    )
    before, during, released, after, again = out.split()
    assert int(during) == int(before) + 1
    assert released == "True"
    assert after == before
    assert int(again) == int(before) + 1


def test_an_idle_engine_thread_releases_its_pool() -> None:
    """The server's engine thread lets its OpenMP workers go when it has no request, so that
    another engine (a second model or version) stepping meanwhile is the only pool. A stub
    engine whose steps run one parallel region (the loop's threading is what is tested)."""
    out = run_fresh_python(
        _COUNT
        + """
import time, torch
from dsinfer.server.async_engine import AsyncEngine
torch.set_num_threads(2)
a = torch.randn(400_000)

class Busy:
    steps = 4
    def has_unfinished_requests(self):
        return self.steps > 0
    def step(self):
        if self.steps > 0:
            self.steps -= 1
            torch.add(a, a)
            time.sleep(0.2)
        return []
    def shutdown(self):
        pass

before = threads()
engine = AsyncEngine(Busy())
time.sleep(0.3)
busy = threads()  # the engine thread and its pool's worker
print(before, busy, settled(before + 1))
engine.shutdown()
"""
    )
    before, busy, idle = (int(x) for x in out.split())
    assert busy == before + 2
    assert idle == before + 1  # the engine thread alone


def test_the_offline_api_leaves_no_pool_behind() -> None:
    """LLM() and LLM.generate release the calling thread's pool when they return: a web app
    that loads on one thread and generates from a pool of worker threads would otherwise hold
    a pool per thread, and every parallel region would pay the futex wake-up."""
    out = run_fresh_python(
        _COUNT
        + """
import threading, torch
torch.set_num_threads(2)
from dsinfer import LLM, SamplingParams
before = threads()
llm = LLM("smollm2")
loaded = settled(before)
llm.generate(["Hello"], SamplingParams(max_tokens=4))
generated = settled(before)
counts = []
def worker():
    llm.generate(["Hello"], SamplingParams(max_tokens=4))
    counts.append(settled(before + 1) - 1)  # this thread, still running, not counted
t = threading.Thread(target=worker)
t.start()
t.join()
print(before, loaded, generated, counts[0])
"""
    )
    before, loaded, generated, in_worker = out.split()
    assert loaded == generated == before
    assert int(in_worker) <= int(before)  # the worker's own pool was let go before it returned
