"""Executor: runs a SchedulerOutput on every rank. World size 1 here: the runner in-process."""

from __future__ import annotations

import torch

from dsinfer.config import CacheConfig
from dsinfer.models.loader import LoadedModel
from dsinfer.worker.model_runner import ModelRunner
from dsinfer.worker.step_io import ModelRunnerOutput, SchedulerOutput


class UniprocExecutor:
    def __init__(
        self,
        loaded: LoadedModel,
        cache: CacheConfig,
        device: torch.device,
        seed: int = 0,
        speculative: bool = True,
        backend: str = "reference",
    ) -> None:
        self.runner = ModelRunner(loaded, cache, device, seed, speculative, backend=backend)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)

    @staticmethod
    def is_engine_fault(exc: BaseException) -> bool:
        """Out of memory is the process's fault, not a request's: the engine restarts rather
        than failing requests one by one. Everything else one process raises is retried
        request by request (engine/fault_isolation.py)."""
        return isinstance(exc, MemoryError | torch.OutOfMemoryError)

    def shutdown(self) -> None:
        """Nothing to stop in one process."""
