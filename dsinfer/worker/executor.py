"""Executors load the model on every rank and run a SchedulerOutput there. World size 1 here:
the runner in-process; `make_executor` picks this one or the multi-process one.

The engine hands an executor its config and a `load(config) -> LoadedModel` function (the
artifact layer's: verify under the trust policy, then read) rather than a loaded model: under
tensor parallelism each rank loads its own part, so loading is the executor's job."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from dsinfer.device.host_threads import core_share, intra_op_threads
from dsinfer.models.loader import LoadedModel
from dsinfer.worker.model_runner import ModelRunner
from dsinfer.worker.multiproc_executor import MultiprocExecutor, world_size
from dsinfer.worker.step_io import ModelRunnerOutput, SchedulerOutput

Loader = Callable[[Any], LoadedModel]


class UniprocExecutor:
    def __init__(self, config: Any, load: Loader, device: torch.device) -> None:
        # On the CPU, steps run on this process's share of the cores (device/host_threads).
        self._share = core_share() if device.type == "cpu" else None
        # Loading (and the step program's thread tuning) on every core: this thread may have
        # started with a busy engine's share as its count (torch's new-thread default).
        with intra_op_threads(self._share.cores) if self._share else nullcontext():
            self.loaded = load(config)
            self.runner = ModelRunner.for_engine(self.loaded, config, device)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self._share is None or not out.seqs:  # (an idle engine's flush of finished ids)
            return self.runner.execute(out)
        with self._share.step(self):  # every core alone; cores // busy engines beside others
            return self.runner.execute(out)

    @staticmethod
    def is_engine_fault(exc: BaseException) -> bool:
        """Out of memory is the process's fault, not a request's: the engine restarts rather
        than failing requests one by one. Everything else one process raises is retried
        request by request (engine/fault_isolation.py)."""
        return isinstance(exc, MemoryError | torch.OutOfMemoryError)

    def shutdown(self) -> None:
        """Nothing to stop in one process."""


def make_executor(
    config: Any, load: Loader, device: torch.device
) -> UniprocExecutor | MultiprocExecutor:
    """One process for world size 1, else rank 0 here and the other ranks spawned."""
    if world_size(config) > 1:
        return MultiprocExecutor(config, load, device)
    return UniprocExecutor(config, load, device)
