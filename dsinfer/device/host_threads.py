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
before the engines load) releases its pool here.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch  # noqa: F401  (loads its libgomp before _libgomp looks for it)

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
