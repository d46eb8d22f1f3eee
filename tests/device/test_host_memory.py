"""Host memory in transparent huge pages (device/host_memory.py): the gathered weights keep
their values and sharing bit for bit, cost one storage more than the model while gathering,
and land in huge pages where the kernel offers them; the KV pool's arena; an engine with and
without huge pages decodes the same tokens."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dsinfer.config import CacheConfig
from dsinfer.device.host_memory import HUGE_PAGE, HugePageArena, gather, huge_pages_mode
from dsinfer.worker.kv_cache import allocate_kv_cache
from tests.helpers import fused_cpu_has, run_fresh_python, tiny_model_config


def _status_kib(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def test_gather_keeps_values_views_and_sharing() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, 70, generator=g)
    view = a[10:20, 5:]  # a strided view into a's storage
    codes = torch.randint(0, 255, (4099,), dtype=torch.uint8, generator=g)
    with torch.inference_mode():  # a model built in inference mode holds inference tensors
        w = torch.nn.Parameter(torch.randn(33, 17, generator=g).bfloat16(), requires_grad=False)
    empty = torch.empty(0, 576)
    meta = torch.empty(8, 8, device="meta")
    tensors = [a, view, codes, w, empty, meta]
    before = [(t.clone(), t.dtype, t.shape, t.stride(), t.storage_offset()) for t in tensors[:4]]
    old_ptrs = [t.data_ptr() for t in tensors[:4]]
    arena = gather(tensors)
    assert arena is not None
    for t, (value, dtype, shape, stride, offset), old in zip(
        tensors, before, old_ptrs, strict=False
    ):
        assert torch.equal(t, value) and t.dtype == dtype and t.shape == shape
        assert t.stride() == stride and t.storage_offset() == offset
        assert t.data_ptr() != old  # moved
        assert t.untyped_storage().data_ptr() % 64 == 0
    # The view still shares its base's storage (a write through one shows in the other).
    assert view.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    a[12, 6] = 123.0
    assert view[2, 1] == 123.0
    # Each gathered tensor has a storage of its own size, one after another in run order.
    assert codes.untyped_storage().nbytes() == 4099
    assert a.data_ptr() < codes.data_ptr() < w.data_ptr()
    assert isinstance(w, torch.nn.Parameter) and w.is_inference()
    assert empty.shape == (0, 576) and meta.device.type == "meta"
    assert gather([empty, meta]) is None


def test_gather_costs_one_storage_more_than_the_tensors_not_twice() -> None:
    """Each old storage is freed as soon as its copy is made, and the heap's freed pages go
    back every 64 MiB: gathering 320 MiB raises the peak resident set by about 64 MiB and a
    storage, not by 320 MiB. Small blocks (under glibc's mmap threshold) and large ones."""
    mib = 2**20
    # Freeing a mapped 31 MiB block raises glibc's mmap threshold to it (as a long-running
    # process's frees do): the 1 MiB blocks below come from the heap, whose freed pages stay
    # resident until trimmed.
    torch.empty(31 * mib // 4).fill_(1)  # written, then freed at once
    tensors = [torch.ones(mib // 4) for _ in range(160)]  # 160 × 1 MiB: heap blocks
    tensors += [torch.ones(8 * mib) for _ in range(5)]  # 5 × 32 MiB: mapped blocks
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
    start = _status_kib("VmHWM")
    gather(tensors)
    grew = (_status_kib("VmHWM") - start) * 1024
    assert grew < 64 * mib + 2 * 32 * mib + HUGE_PAGE, grew / mib
    assert all(t.sum() == t.numel() for t in tensors)


def _huge_kib_of(ptr: int) -> int:
    """AnonHugePages of the mapping holding address `ptr` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(m.group(1), 16) <= ptr < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    huge_pages_mode() not in ("always", "madvise"),
    reason=f"transparent huge pages are {huge_pages_mode()!r} on this machine",
)
def test_gathered_weights_and_kv_pool_sit_in_huge_pages() -> None:
    w = torch.randn(4 * HUGE_PAGE // 4)  # 8 MiB of fp32
    gather([w])
    assert _huge_kib_of(w.data_ptr()) >= HUGE_PAGE // 1024
    arena = HugePageArena(6 * HUGE_PAGE)
    assert arena.advised
    t = arena.empty((3, HUGE_PAGE // 2), torch.bfloat16).zero_()  # 6 MiB, touched
    assert t.data_ptr() % HUGE_PAGE == 0
    assert _huge_kib_of(t.data_ptr()) >= 2 * HUGE_PAGE // 1024


def test_arena_refuses_what_does_not_fit() -> None:
    arena = HugePageArena(1000)
    arena.storage(900)
    with pytest.raises(ValueError, match="do not fit"):
        arena.storage(200)


@pytest.mark.parametrize("mla", [False, True])
def test_kv_pool_in_an_arena_is_zeroed_and_shaped_as_before(mla: bool) -> None:
    cfg = tiny_model_config(num_layers=3, max_len=256, mla=mla)
    cache = CacheConfig(block_size=16, num_blocks=10)
    cpu = torch.device("cpu")
    plain = allocate_kv_cache(cfg, cache, torch.bfloat16, cpu, 256)
    huge = allocate_kv_cache(cfg, cache, torch.bfloat16, cpu, 256, huge_pages=True)
    want, got = plain.caches, huge.caches
    assert plain.num_blocks == huge.num_blocks
    assert [[t.shape for t in layer] for layer in got] == [
        [t.shape for t in layer] for layer in want
    ]
    flat = [t for layer in got for t in layer]
    assert all(t.is_contiguous() and not t.any() for t in flat)
    # One arena: each layer's tensors follow the previous ones.
    assert all(a.data_ptr() < b.data_ptr() for a, b in zip(flat, flat[1:], strict=False))


def test_an_engine_decodes_the_same_tokens_with_and_without_huge_pages() -> None:
    """SmolLM2 on the default fast path (int4, bf16, the captured step program): the gathered
    weights are the same bytes, so greedy decoding gives the same tokens and logprobs."""
    from dsinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    outs = []
    for huge in (False, True):
        llm = LLM("smollm2", kv_cache_memory="32MiB", huge_pages=huge)
        runner = llm.engine.executor.runner
        # Captured where the fused int4 kernels run (AVX2 or AVX-512); eager on older CPUs.
        assert (runner.model.step_program is not None) == fused_cpu_has("int4_vnni")
        # Gathered: the parameters follow each other in registration (run) order.
        ptrs = [p.data_ptr() for p in runner.model.parameters() if p.numel()]
        assert (ptrs == sorted(ptrs)) is huge
        outs.append(llm.generate(prompts, params))
        del llm
    for off, on in zip(*outs, strict=True):
        assert off.outputs[0].token_ids == on.outputs[0].token_ids
        assert [lp.logprob for lp in off.outputs[0].logprobs] == [
            lp.logprob for lp in on.outputs[0].logprobs
        ]


def test_gather_copies_only_the_bytes_the_tensors_use() -> None:
    """Two small tensors at both ends of one large storage (a compiled artifact's file mapping
    holds a shard's every weight, some replaced by repacked copies since): two small copies,
    not the storage; a third tensor overlapping the first joins its copy."""
    big = torch.arange(4 << 20, dtype=torch.uint8)  # 4 MiB
    first, last = big[:1000].view(torch.int8), big[-1024:].view(torch.int32)
    inner = big[512:2048]  # overlaps `first`
    want = [first.clone(), last.clone(), inner.clone()]
    arena = gather([first, last, inner])
    assert arena is not None and arena.nbytes < 8192
    assert [torch.equal(a, b) for a, b in zip((first, last, inner), want, strict=True)] == [
        True
    ] * 3
    assert first.untyped_storage().data_ptr() == inner.untyped_storage().data_ptr()
    assert last.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert last.untyped_storage().nbytes() == 1024
    assert last.data_ptr() % 64 == 0 and inner.data_ptr() - first.data_ptr() == 512


_HEAP_PROBE = """
import ctypes, torch
from dsinfer.device.host_memory import loading_heap, scratch_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def mapped_by(nbytes):  # bytes of blocks glibc mapped by themselves while a storage lived
    before = libc.mallinfo2().hblkhd
    t = torch.empty(nbytes, dtype=torch.uint8)
    grown = libc.mallinfo2().hblkhd - before
    del t
    return grown

with loading_heap():
    with loading_heap():
        inner = mapped_by(4 << 20)
    outer = mapped_by(4 << 20)
serving, huge = mapped_by(4 << 20), mapped_by(64 << 20)
with loading_heap():
    with scratch_heap():
        scratch = mapped_by(4 << 20)
    after = mapped_by(24 << 20)  # larger than any free block the scratch left on the heap
print(inner, outer, serving, huge, scratch, after)
"""


def test_loading_maps_large_storages_and_serving_keeps_them_on_the_heap() -> None:
    """Under loading_heap a 4 MiB storage is a mapping of its own (freed, it leaves no hole in
    the heap); after it, the serving thresholds put the same storage on the heap (no mapping,
    no page faults per step). Overlapping loads restore the serving values with the last. In a
    fresh process: glibc serves a request from a free heap block of the size before it maps,
    and this test process's heap has those."""
    inner, outer, serving, huge, _, _ = (int(x) for x in run_fresh_python(_HEAP_PROBE).split())
    assert inner >= 4 << 20 and outer >= 4 << 20
    assert serving == 0
    assert huge >= 64 << 20  # past the serving threshold: mapped, as glibc's own would


def test_a_scratch_phase_of_a_load_keeps_its_temporaries_on_the_heap() -> None:
    """Inside loading_heap, scratch_heap (the direct GGUF packing's GBs of temporaries) puts a
    4 MiB storage on the heap, not in a fresh mapping faulted in page by page; after it the
    load's threshold is back (a larger storage mapped by itself: the freed 4 MiB block may
    serve a request of its size from the heap)."""
    *_, scratch, after = (int(x) for x in run_fresh_python(_HEAP_PROBE).split())
    assert scratch == 0
    assert after >= 24 << 20


_ARENA_PROBE = r"""
import ctypes, os, re, tempfile, threading
import torch
from dsinfer.device.host_memory import limit_malloc_arenas
torch.set_num_threads(2)
limit_malloc_arenas()  # one a forward thread (2) and two more: 4
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
# Twelve threads allocate at the same moment: glibc gives each a fresh arena while it may.
barrier = threading.Barrier(12)
def grab():
    barrier.wait()
    for _ in range(200):
        libc.free(libc.malloc(8192))
threads = [threading.Thread(target=grab) for _ in range(12)]
[t.start() for t in threads]
[t.join() for t in threads]
path = tempfile.mktemp()
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, fp)
libc.fclose(fp)
print(len(re.findall(r'<heap nr="\d+">', open(path).read())))
os.unlink(path)
"""


def test_a_server_keeps_one_malloc_arena_a_forward_thread_and_two_more() -> None:
    """Twelve threads allocating at once get at most 4 arenas (two forward threads + 2), not
    glibc's 8 a core; and more than one, so the forward's threads do not queue on one lock."""
    out = run_fresh_python(_ARENA_PROBE)
    assert 2 <= int(out) <= 4, out
