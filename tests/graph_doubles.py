"""Stand-ins for torch.cuda's graph API, so that device/graphs.py's own recording code runs
on the CPU as a CUDA graph would behave (tests/worker/test_decode_graphs.py, tests/engine/
test_graphed_engine.py). The CPU's EagerGraph runs the step's Python again at every replay, so
it can see neither fault a CUDA graph has shown or could show: reading a tensor freed since
capture (AddressGraph), or a value the step took from the host while recording (ReplayingGraph).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _ReadsFromOutside(TorchDispatchMode):
    """Weak references to every tensor a recording reads that it did not make itself: what a
    recorded graph reads by address at each replay (it holds no reference to them)."""

    def __init__(self, reads: list[weakref.ref]) -> None:
        super().__init__()
        self.reads = reads
        self.made: set[int] = set()
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and id(t) not in self.made | self.seen:
                self.seen.add(id(t))
                self.reads.append(weakref.ref(t))
        self.made.update(id(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


class AddressGraph:
    """A CUDA graph's stand-in: replay does nothing; it knows which tensors from outside the
    recording it would read, and which of them have been freed since (memory that a real
    graph would go on reading after the allocator gave it to someone else)."""

    def __init__(self) -> None:
        self.reads: list[weakref.ref] = []

    def recording(self) -> TorchDispatchMode:
        return _ReadsFromOutside(self.reads)

    def replay(self) -> None:
        pass

    def freed(self) -> int:
        return sum(r() is None for r in self.reads)


class _Recording(TorchDispatchMode):
    """Every aten op a recording runs, with the very tensors it ran on."""

    def __init__(self, ops: list) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


def _shares_storage(out: object, args: object) -> bool:
    """Whether an op's tensor output is a view of one of its tensor inputs (reshape, to and
    contiguous may return either a view or a copy: what they did is what counts)."""
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    ins = {t.untyped_storage().data_ptr() for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
    return bool(outs) and all(t.untyped_storage().data_ptr() in ins for t in outs)


class ReplayingGraph:
    """A CUDA graph's stand-in that replays: the aten ops of the recording run again on the
    tensors they were recorded on, in order, each new result copied into the tensor it made
    when recorded; ops that write their inputs run again in place; views need nothing (they
    show what was written below them). No Python of the captured function runs again, so any
    value it took from the host while recording (a length, a branch) stays as recorded, as in
    a CUDA graph. (It holds what it recorded: freed inputs are AddressGraph's check.)"""

    def __init__(self) -> None:
        self.ops: list = []

    def recording(self) -> TorchDispatchMode:
        return _Recording(self.ops)

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            writes = any(
                a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments
            )
            if not writes and _shares_storage(out, (args, kwargs)):
                continue  # a view: it reads what the ops before it wrote
            fresh = func(*args, **kwargs)
            if writes:
                continue  # it wrote its inputs again
            for kept, new in zip(tree_leaves(out), tree_leaves(fresh), strict=True):
                if isinstance(kept, torch.Tensor):
                    kept.copy_(new)


class GraphAPI:
    """torch.cuda's graph API as device/graphs.py uses it, with one of the stand-ins above as
    its CUDAGraph (it records while the `graph` context is open)."""

    def __init__(self, graph_class: type) -> None:
        # device/graphs.py takes NPUGraph from any graph module but torch.cuda itself.
        self.NPUGraph = graph_class

    class Stream:
        def wait_stream(self, other: object) -> None:
            pass

    def current_stream(self) -> Stream:
        return self.Stream()

    def stream(self, s: object) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass

    @contextlib.contextmanager
    def graph(self, g: AddressGraph | ReplayingGraph, pool: object = None) -> Iterator[None]:
        with g.recording():
            yield


def record_graphs(
    monkeypatch: pytest.MonkeyPatch, graph_class: type, everywhere: bool = False
) -> None:
    """Decode graphs recorded through device/graphs.py with `graph_class` as the CUDA graph;
    `everywhere`: runners on the CPU record them too (as on CUDA, where the device decides)."""
    from dsinfer.device import graphs as device_graphs
    from dsinfer.worker.model_runner import ModelRunner

    api = GraphAPI(graph_class)
    monkeypatch.setattr(
        "dsinfer.worker.decode_graphs.new_step_graph",
        lambda device: device_graphs._RecordedGraph(api, None),
    )
    if everywhere:
        monkeypatch.setattr(ModelRunner, "_graphs_wanted", lambda self, program, graphs: True)
