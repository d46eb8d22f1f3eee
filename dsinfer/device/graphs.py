"""Captured step graphs: a function recorded once on an accelerator and replayed per step.

A GPU server captures its decode step once per batch size (a CUDA graph) so that a step costs
one launch instead of hundreds of kernel launches from Python. This module is the only place
that names the device APIs for it: `torch.cuda.CUDAGraph` on CUDA, `torch.npu.NPUGraph` on
Ascend (torch_npu). The CPU has no graphs; `EagerGraph` runs the function on every replay with
the same static-buffer contract, so the bucket and padding logic around a graph
(worker/decode_graphs.py) is tested on the CPU machines here.

Contract of a graph: `capture(fn)` runs fn (warm-up and recording) and keeps its result tensor;
every `replay()` recomputes that same tensor in place from whatever the static input buffers
hold now. Inputs and outputs are fixed tensors: callers copy into the inputs before replay and
read the output before the next replay. A graph also keeps fn, and with it every tensor fn
closes over: a recorded graph reads those by address, holding no reference of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from dsinfer.device import _npu_available


class StepGraph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> torch.Tensor: ...


class EagerGraph:
    """No capture: replay calls the function again (CPU, and tests of the code around graphs)."""

    def __init__(self) -> None:
        self._fn: Callable[[], torch.Tensor] | None = None
        self._out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._fn = fn
        self._out = fn()
        return self._out

    def replay(self) -> torch.Tensor:
        assert self._fn is not None and self._out is not None, "replay before capture"
        # The same output tensor every time, as a recorded graph gives.
        self._out.copy_(self._fn())
        return self._out


class _RecordedGraph:
    """A CUDA or NPU graph: warmed up on a side stream (lazy initialisations such as cuBLAS
    workspaces must not be recorded), then recorded once into a memory pool shared by every
    graph of the process (graphs replay one at a time, so they may share intermediates)."""

    def __init__(self, mod: Any, pool: Any, warmup: int = 2) -> None:
        self._mod = mod  # torch.cuda or torch.npu
        self._pool = pool
        self._warmup = warmup
        self._graph: Any = None
        self._out: torch.Tensor | None = None
        self._fn: Callable[[], torch.Tensor] | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        # The recording reads the tensors fn closes over by address at every replay, and
        # nothing else refers to some of them (decode_graphs' span of positions for the mask):
        # dropped with fn, their memory would go to the next step's tensors while the graph
        # still read it: the cause found for replayed logits off by their own size on an H100
        # (session 28; the fix not yet re-run there).
        self._fn = fn
        mod = self._mod
        side = mod.Stream()
        side.wait_stream(mod.current_stream())
        with mod.stream(side):
            for _ in range(self._warmup):
                fn()
        mod.current_stream().wait_stream(side)
        mod.synchronize()
        if mod is torch.cuda:
            graph = mod.CUDAGraph()
            # "thread_local": an action that capture forbids (a cudaMalloc, a sync) fails on
            # this thread only. torch's default, "global", fails it on every thread, so one
            # engine recording a new bucket would fail the step another engine of the same
            # process (a second model, a canary's other version) runs meanwhile. The capture
            # stream is one of torch's non-blocking streams: other threads' work on theirs
            # cannot join the recording.
            recording = mod.graph(graph, pool=self._pool, capture_error_mode="thread_local")
        else:
            graph = mod.NPUGraph()
            recording = mod.graph(graph, pool=self._pool)
        with recording:
            self._out = fn()
        self._graph = graph
        return self._out

    def replay(self) -> torch.Tensor:
        assert self._graph is not None and self._out is not None, "replay before capture"
        self._graph.replay()
        return self._out


_POOLS: dict[str, Any] = {}


def graphs_unavailable(device: torch.device) -> str | None:
    """Why steps cannot be recorded as graphs on `device`, or None."""
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is visible"
    if device.type == "npu":
        if not _npu_available():
            return "torch_npu is missing or sees no NPU"
        return None if hasattr(torch.npu, "NPUGraph") else "this torch_npu has no NPUGraph"  # type: ignore[attr-defined]
    return f"{device.type} has no graph capture"


def new_step_graph(device: torch.device) -> StepGraph:
    """A graph for one captured step on `device` (an EagerGraph on the CPU)."""
    if device.type == "cpu":
        return EagerGraph()
    if why := graphs_unavailable(device):
        raise ValueError(f"cannot capture step graphs on {device}: {why}")
    mod = torch.cuda if device.type == "cuda" else torch.npu  # type: ignore[attr-defined]
    if device.type not in _POOLS:
        _POOLS[device.type] = mod.graph_pool_handle()
    return _RecordedGraph(mod, _POOLS[device.type])
