"""Host memory in transparent huge pages: where a CPU engine keeps its weights and KV pool.

Why: a decode step at one row streams every weight once (SmolLM2: 94 MiB a token, DeepSeek-V2-
Lite ~1.4 GB). In 4 KiB pages that is one TLB miss every 4 KiB, and the CPU's stream prefetcher
starts over at every page boundary; in 2 MiB pages neither happens. Measured on a Zen 2 (AVX2,
2 vCPUs, a VM): SmolLM2's 30 int4 layers at one row read from memory at 18 GB/s in 4 KiB pages
and 23-24 GB/s in huge pages (a harness, the same kernel); its captured decode step 6.05 / 6.53
→ 5.33 / 5.09 ms (docs/benchmarks.md, session 21). torch allocates each tensor by itself, most
of them under 2 MiB (a SmolLM2 projection is 0.2-0.9 MiB), where no huge page fits even with
THP_MEM_ALLOC_ENABLE: so the weights are copied, in the order the model runs them, into one
private anonymous mapping advised MADV_HUGEPAGE (`gather`), and the KV pool is carved from
another (`HugePageArena`).

Linux only, and only where /sys/kernel/mm/transparent_hugepage/enabled is `madvise` or
`always` (`huge_pages_mode`); elsewhere the arena is an ordinary mapping (the same memory, in
small pages) and nothing else changes. The copies are bit for bit: every tensor keeps its
dtype, shape, strides, storage offset and the storages it shares with others (a tied head).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) transparent huge page size
_ALIGN = 64  # every storage starts on a cache line (the kernels' vector loads)
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# gather returns the heap's free pages every this many bytes of freed storages: glibc keeps
# the pages of freed small blocks (a projection under its mmap threshold) until trimmed, and
# gathering would otherwise hold a second copy of every such weight until its end.
_TRIM_EVERY = 64 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (malloc_trim, mallopt), else None: every heap setting
    here is then a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018  (AttributeError where they are absent)
    except (OSError, AttributeError):
        return None
    return libc


def available_bytes() -> int | None:
    """What the kernel says a new allocation can take without swapping (MemAvailable: free
    memory plus reclaimable cache), or None where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def release_freed_memory() -> None:
    """Return the heap's free pages to the OS (glibc malloc_trim): without it, the float
    copies a load-time quantisation frees, and the storages gathered into an arena, stay in
    the process's resident set."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# glibc's mallopt parameters (malloc.h) and the values loading_heap switches between.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_LOAD_MMAP_THRESHOLD = 128 << 10  # glibc's initial threshold: every storage above it mapped
_SERVE_MMAP_THRESHOLD = 32 << 20  # the ceiling glibc's own adaptive threshold climbs to
_SERVE_TRIM_THRESHOLD = 64 << 20  # twice it, as glibc keeps them
_loads = 0
_loads_lock = threading.Lock()


def _mallopt(param: int, value: int) -> None:
    libc = _glibc()
    if libc is not None:
        libc.mallopt(param, value)


def limit_malloc_arenas(arenas: int | None = None) -> None:
    """Bound glibc's malloc arenas (it allows 8 a core) to one a thread of the forward's team,
    one for the event loop and one for the other threads. Before any thread starts.

    Why not fewer: threads that share an arena take turns on its lock whenever they allocate
    inside a parallel region. Our kernels no longer do (the scratch rule in cpu_ops.cpp), but
    torch's operators may. Measured with one arena (two cores), before that rule: the decode
    forward 1.70 → 2.15 ms, one served stream 5-10% slower, for no smaller peak RSS (798-811
    against 796-813 MiB under 16 streams; the ~18 MiB one arena once saved went with
    loading_heap). Why a bound at all: on a large machine glibc's default lets each of a
    server's many threads keep an arena of freed memory."""
    _mallopt(_M_ARENA_MAX, arenas if arenas is not None else torch.get_num_threads() + 2)


@contextmanager
def loading_heap() -> Iterator[None]:
    """Load a model with every storage over 128 KiB in a mapping of its own, then serve with
    the heap glibc settles on for steady load.

    Why: glibc raises its mmap threshold each time it frees a mapped block, so after the first
    few load-time tensors the rest (the float copies quantisation frees, the storages gathered
    into the weights' arena: 0.2-3.5 MiB each for SmolLM2) land on the heap and leave holes
    there when freed. Trimming returns the holes' pages, but the heap cannot shrink past the
    live blocks above them, and serving then scatters its per-step tensors over the holes,
    faulting their pages back in: SmolLM2's heap was 201 MiB for 96 MiB in use at start-up,
    and a 16-prompt burst added 46 MiB of resident memory. Loaded this way the heap is 95 MiB
    and the same burst adds 22 MiB, at the same speed (measured, docs/benchmarks.md, session
    25). Serving keeps fixed thresholds at the adaptive ones' ceilings (a mapping per step's
    tensor would fault its pages in every step: −30% tokens/s, measured). Loads may overlap
    (a second model loading while the first serves): the serving values return with the last."""
    global _loads
    with _loads_lock:
        _loads += 1
        if _loads == 1:
            _mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        with _loads_lock:
            _loads -= 1
            if _loads == 0:
                _mallopt(_M_MMAP_THRESHOLD, _SERVE_MMAP_THRESHOLD)
                _mallopt(_M_TRIM_THRESHOLD, _SERVE_TRIM_THRESHOLD)
        release_freed_memory()


@contextmanager
def scratch_heap() -> Iterator[None]:
    """Inside a `loading_heap`, a phase whose temporaries are many and large keeps them on the
    heap, as glibc's own ceiling would (mmap threshold 32 MiB), then returns to the load's
    threshold and trims the heap. Elsewhere it changes nothing.

    Why: under the load's 128 KiB threshold every temporary is a fresh mapping whose pages fault
    in zeroed and are unmapped when freed. The direct GGUF packing (models/gguf_int4.py) passes
    GBs of cache-sized temporaries through torch for a DeepSeek-V2-Lite file: `load_model`
    took 114 s inside the server's loading_heap against 70 s outside it. Its lasting storages
    (the packed projections and expert stacks' scales) may land on the heap beside freed
    temporaries: the fused backend replaces them with its repacked layouts, and the weights are
    gathered into one arena after, freeing them (holes whose pages the trims return)."""
    with _loads_lock:
        active = _loads > 0
        if active:
            _mallopt(_M_MMAP_THRESHOLD, _SERVE_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if active:
            with _loads_lock:
                if _loads > 0:
                    _mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP_THRESHOLD)
            release_freed_memory()


def huge_pages_mode() -> str:
    """The kernel's THP policy: `always`, `madvise`, `never`, or `unavailable` (not Linux, or
    no THP). Under `madvise` only advised ranges get huge pages, which is what the arena asks."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return "unavailable"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unavailable"


class HugePageArena:
    """One private anonymous mapping of `nbytes` (plus a huge page, so that the first storage
    starts on a 2 MiB boundary), advised MADV_HUGEPAGE, handed out as cache-line-aligned
    storages. Its memory is zero until written, and is returned to the OS when the mapping and
    every storage taken from it are gone (each storage holds the mapping)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        # MAP_PRIVATE: Python's default (MAP_SHARED) is shared memory, which THP does not back
        # under its usual shmem setting (`never`).
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.advised = huge_pages_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")
        if self.advised:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        base = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        self._next = (-base) % HUGE_PAGE  # the first 2 MiB boundary inside the mapping
        self._end = self._next + nbytes

    def storage(self, nbytes: int) -> torch.UntypedStorage:
        """The next `nbytes` of the arena as a storage of its own (64-byte aligned)."""
        start = -(-self._next // _ALIGN) * _ALIGN
        if nbytes <= 0 or start + nbytes > self._end:
            raise ValueError(f"arena: {nbytes} bytes at {start} do not fit in {self.nbytes}")
        self._next = start + nbytes
        return torch.frombuffer(
            self._map, dtype=torch.uint8, count=nbytes, offset=start
        ).untyped_storage()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor in the arena (zero until written: fresh anonymous memory)."""
        t = torch.empty(0, dtype=dtype)
        return t.set_(self.storage(math.prod(shape) * t.element_size()), 0, shape)

    @staticmethod
    def size_for(nbytes: Iterable[int]) -> int:
        """Arena bytes that hold storages of these sizes taken one after another."""
        return sum(-(-n // _ALIGN) * _ALIGN for n in nbytes) + _ALIGN


def copy_buffers(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bandwidth probe's source (ones) and destination (zeros) of `nbytes` each, touched, in
    one arena: the pages the weights and the KV pool are read from (in 4 KiB pages a copy ran
    ~20-30% slower on a Zen 2 VM, which would overstate MBU and the cost model's streaming)."""
    arena = HugePageArena(HugePageArena.size_for([nbytes, nbytes]))
    src = arena.empty((nbytes // 4,), torch.float32).fill_(1.0)
    return src, arena.empty((nbytes // 4,), torch.float32).zero_()


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of its storage that `t` reaches (strides are never negative)."""
    es = t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return t.storage_offset() * es, (t.storage_offset() + last + 1) * es


def _spans(users: list[torch.Tensor]) -> list[tuple[int, int, list[torch.Tensor]]]:
    """The tensors of one storage in runs of overlapping byte spans: [(start, end, tensors)],
    start aligned down to 64 bytes (so each tensor keeps its alignment modulo 64 when moved)."""
    runs: list[tuple[int, int, list[torch.Tensor]]] = []
    for (lo, hi), t in sorted(((_byte_span(t), t) for t in users), key=lambda p: p[0][0]):
        if runs and lo < runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], hi), [*runs[-1][2], t])
        else:
            runs.append((lo - lo % _ALIGN, hi, [t]))
    return runs


def gather(tensors: Iterable[torch.Tensor]) -> HugePageArena | None:
    """Copy the bytes the CPU tensors in `tensors` use (once each, in the order first met) into
    one arena and point every tensor at its copy, in place: the same Python objects
    (parameters, buffers, and whatever captured them later), the same values bit for bit.
    Tensors that overlap in a storage (a view, a tied head) share one copy; tensors that merely
    live in one large storage (a compiled artifact's file mapping holds every weight of a shard,
    some already replaced by their repacked layouts) are copied apart, without the bytes between
    them. None when there is nothing to gather. Call it before anything binds the tensors'
    addresses (a captured step program). Freed pages go back to the OS as it goes
    (release_freed_memory every 64 MiB, and at the end)."""
    groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        st = t.untyped_storage()
        if t.device.type != "cpu" or st.nbytes() == 0 or t.numel() == 0:
            continue
        groups.setdefault(st.data_ptr(), (st, []))[1].append(t)
    if not groups:
        return None
    spans = {key: _spans(users) for key, (_, users) in groups.items()}
    arena = HugePageArena(
        HugePageArena.size_for(hi - lo for r in spans.values() for lo, hi, _ in r)
    )
    # Inference mode: a model built under it holds inference tensors, which only take in-place
    # updates there (normal tensors take them too).
    freed = 0
    with torch.inference_mode():
        for key in list(groups):
            old, users = groups.pop(key)
            src = torch.empty(0, dtype=torch.uint8).set_(old)  # the storage's bytes
            for lo, hi, run in spans.pop(key):
                new = arena.storage(hi - lo)
                torch.empty(0, dtype=torch.uint8).set_(new).copy_(src[lo:hi])
                for t in run:
                    offset = (t.storage_offset() * t.element_size() - lo) // t.element_size()
                    t.set_(new, offset, t.size(), t.stride())
                freed += hi - lo
            # The last references to the old storage: it is freed now, not after the loop, so
            # that gathering a model costs one storage more than the model, not twice it.
            del old, users, src
            if freed >= _TRIM_EVERY:
                release_freed_memory()
                freed = 0
    release_freed_memory()
    return arena
