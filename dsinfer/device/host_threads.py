"""Host threads and torch's OpenMP runtime (GNU libgomp on Linux x86 wheels).

Why this module exists: libgomp keeps one pool of worker threads per thread that has run a
parallel region (its "master"). While the process has more such threads than CPUs, libgomp
stops spinning between regions ("throttled" waits of ~100 iterations) and every parallel
region of every master wakes its workers through a futex instead. Measured on the 2-vCPU CI
machine, one short 2-thread region (an add of 200,000 floats): 12-17 µs with one pool, 54-68
µs once a second thread holds a pool, 13-15 µs again after that thread paused its pool or
exited. A decode step runs ~120 regions: the engine thread's step went from 1.4 to 6.3 ms at
one row, and the server's start-up tuning then kept one thread (session 27: one module-level
`torch.ones(...).triu_()` had given the importing main thread a pool).

So: the serving process runs its parallel regions on the engine thread only, nothing runs a
torch op at import, and a thread that has finished its parallel work (the server's main thread
before the engines load) releases its pool here. Where several engines of one process step at
once (two models, a canary's two versions), each steps on its share of the cores
(`CoreShare`): on two cores, one thread each, whose parallel regions run inline.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch  # (loads its libgomp before _libgomp looks for it)

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what can be kept


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), or None: another OpenMP runtime, or a
    platform without /proc."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    # torch's own copy first, should an extension have brought another.
    candidates = sorted((p for p in paths if p.startswith("/")), key=lambda p: "/torch/" not in p)
    if not candidates:
        return None
    path = candidates[0]
    lib = ctypes.CDLL(path)  # already loaded: the same handle, nothing new mapped
    return lib if hasattr(lib, "omp_pause_resource_all") else None


def release_openmp_pool() -> bool:
    """Let the calling thread's OpenMP worker threads go (OpenMP 5's omp_pause_resource_all);
    its next parallel region starts a new pool (~50 µs, once). True when a libgomp did it."""
    lib = _libgomp()
    if lib is None:
        return False
    ok = lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    if not ok:  # called inside a parallel region: libgomp refuses, nothing changes
        logger.debug("omp_pause_resource_all refused")
    return ok


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """The calling thread's intra-op threads set to n inside, put back after. (torch's setting
    is per thread, but also the count a new thread starts with: put back, nothing outside the
    block sees n.)"""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)  # ~0.1 µs
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


# How long after its last step an engine still counts as busy: a busy engine's steps are
# separated by its Python work between them (scheduling, sampling, delivering tokens: ~0.3-2
# ms), and one engine taking every core in such a gap, while another is mid-step on its share,
# oversubscribes the cores. An engine idle this long has no request left to step.
BUSY_LINGER_S = 0.05


class CoreShare:
    """The host's intra-op threads split between the engines of this process that are stepping.

    Why: two busy engines in one process (two models, or a canary's two versions) each ran
    their steps on every intra-op thread, so each held an OpenMP pool and every parallel region
    of both paid the throttled wake-ups described above, besides the cores' contention. Two
    SmolLM2 engines, one stream each, gave 337.6 tok/s together where one alone gives 345.5.
    On a share each engine steps on cores // busy threads; on two cores that is one thread
    each, whose regions run inline (no pool is woken): 471.1 tok/s together, and at 16
    streams each 1,475.6 → 1,628.1 (benchmarks/two_engines.py, one run; docs/backends.md).
    Alone, an engine keeps every thread; cores that do not divide evenly go one each to the
    first engines.

    `step(key)` around one step of the engine `key`: sets the calling thread's intra-op
    threads to the share for the step and puts back what it was after (torch.set_num_threads
    also sets the count a new thread starts with: nothing outside the step sees the share)."""

    def __init__(self, cores: int, linger_s: float = BUSY_LINGER_S) -> None:
        self.cores = max(1, cores)
        self.linger_s = linger_s
        self.enabled = True  # off: every engine steps on all the cores (benchmarks compare)
        self._lock = threading.Lock()
        self._stepping: dict[int, int] = {}  # id(key) → steps it has in flight
        self._last_end: dict[int, float] = {}  # id(key) → when its last step ended

    def _busy_ids(self, now: float) -> list[int]:
        """The ids of the engines stepping now or within the linger, in order (under _lock)."""
        lingering = {k for k, t in self._last_end.items() if now - t < self.linger_s}
        return sorted(lingering | {k for k, n in self._stepping.items() if n})

    def busy(self) -> int:
        """How many engines are stepping now or stepped within the linger."""
        with self._lock:
            return len(self._busy_ids(time.monotonic()))

    def threads(self) -> int:
        """The fewest intra-op threads any busy engine gets now (a step's own share: step)."""
        with self._lock:
            ids = self._busy_ids(time.monotonic())
        return self._share_of(None, ids)

    def _share_of(self, k: int | None, ids: list[int]) -> int:
        """Engine id k's threads among the busy `ids`: cores // busy each, and the remainder
        one more each for the first engines, so that three cores give two engines 2 and 1,
        not 1 and 1."""
        if not self.enabled or not ids:
            return self.cores
        base, extra = divmod(self.cores, len(ids))
        rank = ids.index(k) if k in ids else len(ids)
        return max(1, base + (1 if rank < extra else 0))

    @contextmanager
    def step(self, key: object) -> Iterator[int]:
        """One step of engine `key` on its share of the cores; yields the thread count."""
        k = id(key)
        with self._lock:
            self._stepping[k] = self._stepping.get(k, 0) + 1
            n = self._share_of(k, self._busy_ids(time.monotonic()))
        try:
            with intra_op_threads(n):
                yield n
        finally:
            with self._lock:
                self._stepping[k] -= 1
                if not self._stepping[k]:
                    del self._stepping[k]
                now = time.monotonic()
                self._last_end[k] = now
                # Forget engines long idle (a swapped-out version): the map stays small.
                for e in [e for e, t in self._last_end.items() if now - t > 60]:
                    del self._last_end[e]


_SHARE: CoreShare | None = None
_SHARE_LOCK = threading.Lock()


def core_share() -> CoreShare:
    """The process's CoreShare, made on first use with the calling thread's intra-op thread
    count as the cores to share (the first engine's loading thread: torch's default, or what
    the application set before loading). DSINFER_CORE_SHARE=off in the environment turns the
    share off."""
    global _SHARE
    with _SHARE_LOCK:
        if _SHARE is None:
            _SHARE = CoreShare(torch.get_num_threads())
            # DSINFER_CORE_SHARE=off: every engine steps on every core (for comparisons).
            _SHARE.enabled = os.environ.get("DSINFER_CORE_SHARE", "on").lower() != "off"
        return _SHARE
