"""Tensor or pipeline parallel over torch.distributed: rank 0 (this process) schedules; every step's
SchedulerOutput is broadcast to the worker ranks, all ranks run the forward pass (the row-
parallel layers all-reduce), and rank 0 samples.

Each worker joins the process group *before* it builds its model, so every rank allocates and
loads only its own shard and its own KV heads. Workers are spawned processes with
`cpu_count // tp` threads each; a worker that dies breaks the collective, which raises on
rank 0 (the server then reports the engine dead: 503, /health 503).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

import torch

from dsinfer.distributed.comm import broadcast_object
from dsinfer.distributed.parallel_state import (
    destroy_parallel,
    free_local_port,
    init_parallel,
)
from dsinfer.worker.model_runner import ModelRunner
from dsinfer.worker.step_io import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def _threads(tp: int) -> int:
    return max(1, (os.cpu_count() or 1) // tp)


def _worker(rank: int, size: int, port: int, config: Any, load: Callable, device: str) -> None:
    torch.set_num_threads(_threads(size))
    init_parallel(
        rank, config.tensor_parallel, config.pipeline_parallel, port, config.expert_parallel
    )
    loaded = load(config)
    runner = ModelRunner(loaded, config.cache, torch.device(device), config.seed, driver=False)
    while True:
        out = broadcast_object(None)
        if out is None:
            break
        runner.execute(out)
    destroy_parallel()


class MultiprocExecutor:
    def __init__(self, config: Any, load: Callable, device: torch.device) -> None:
        size = config.tensor_parallel * config.pipeline_parallel * config.expert_parallel
        port = free_local_port()
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, size, port, config, load, str(device)), daemon=True
            )
            for r in range(1, size)
        ]
        for p in self.procs:
            p.start()
        torch.set_num_threads(_threads(size))
        init_parallel(
            0, config.tensor_parallel, config.pipeline_parallel, port, config.expert_parallel
        )
        try:
            self.loaded = load(config)
            self.runner = ModelRunner(
                self.loaded, config.cache, device, config.seed, speculative=False
            )
        except BaseException:
            for p in self.procs:
                p.kill()
            destroy_parallel()
            raise
        logger.info(
            "tp=%d pp=%d ep=%d over %d processes (gloo)",
            config.tensor_parallel,
            config.pipeline_parallel,
            config.expert_parallel,
            size,
        )

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        dead = [p.pid for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) {dead} died")
        broadcast_object(out)
        return self.runner.execute(out)

    def shutdown(self) -> None:
        if all(p.is_alive() for p in self.procs):
            broadcast_object(None)
        for p in self.procs:
            p.join(timeout=10)
        destroy_parallel()
