"""Parallel execution over torch.distributed: rank 0 (this process) schedules; every step's
SchedulerOutput is broadcast to the worker ranks, all ranks run the forward pass (the
row-parallel layers and MoE all-reduce inside each pipeline stage, stages send activations),
and rank 0 samples.

Each worker joins the process group *before* it builds its model, so every rank allocates and
loads only its own shard and its own KV. Workers are spawned processes with
`cpu_count // ranks-on-this-node` threads each; a local worker that dies is seen before the
next step, which raises on rank 0 (the server then reports the engine dead: 503, /health 503).
A rank on another node that dies breaks the next collective, which raises after
COLLECTIVE_TIMEOUT.

Several nodes: the world's ranks are spread evenly, node n runs ranks [n·k, (n+1)·k). Node 0
runs this executor (rank 0 and its local workers); every other node runs `run_worker_node`
(`dsinfer serve|generate … --node-rank n`), which starts its ranks and waits for them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

import torch

from dsinfer.device import distributed_backend, rank_device
from dsinfer.device.host_memory import loading_heap
from dsinfer.distributed.comm import broadcast_object
from dsinfer.distributed.parallel_state import (
    check_grid,
    destroy_parallel,
    free_local_port,
    in_group,
    init_parallel,
)
from dsinfer.worker.model_runner import ModelRunner
from dsinfer.worker.step_io import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def world_size(config: Any) -> int:
    return check_grid(config.tensor_parallel, config.pipeline_parallel, config.expert_parallel)


def node_ranks(config: Any) -> range:
    """The global ranks this node runs."""
    world, nodes = world_size(config), config.nnodes
    if nodes < 1 or not 0 <= config.node_rank < nodes:
        raise ValueError(f"--node-rank {config.node_rank} must be in [0, --nnodes {nodes})")
    if world % nodes:
        raise ValueError(f"{world} ranks do not spread evenly over --nnodes {nodes}")
    per = world // nodes
    return range(config.node_rank * per, (config.node_rank + 1) * per)


def rendezvous_port(config: Any) -> int:
    if config.master_port is not None:
        return int(config.master_port)
    if config.nnodes > 1:
        raise ValueError("several nodes need --master-port (and --master-addr) on every node")
    return free_local_port()


def _join(rank: int, config: Any, port: int, device: torch.device) -> torch.device:
    """Bind this rank's device and threads, then join the group (before any model exists)."""
    local = node_ranks(config)
    dev = rank_device(device, rank - local.start)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(local)))
    init_parallel(
        rank,
        config.tensor_parallel,
        config.pipeline_parallel,
        port,
        config.expert_parallel,
        distributed_backend(device),
        config.master_addr,
    )
    return dev


def _worker(rank: int, port: int, config: Any, load: Callable, device: str) -> None:
    dev = _join(rank, config, port, torch.device(device))
    with loading_heap():  # as the engine's own rank loads (device/host_memory.py)
        loaded = load(config)
        runner = ModelRunner.for_engine(loaded, config, dev, driver=False)
    while True:
        out = broadcast_object(None)
        if out is None:
            break
        runner.execute(out)
    destroy_parallel()


def _spawn(ranks: range, port: int, config: Any, load: Callable, device: torch.device) -> list:
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, port, config, load, str(device)), daemon=True)
        for r in ranks
    ]
    for p in procs:
        p.start()
    return procs


def run_worker_node(config: Any, load: Callable, device: torch.device) -> int:
    """A node other than 0: run its ranks until rank 0 shuts the group down; 0 if all ended
    cleanly."""
    ranks = node_ranks(config)
    port = rendezvous_port(config)
    procs = _spawn(ranks, port, config, load, device)
    logger.info(
        "node %d/%d: ranks %d-%d joining %s:%d",
        config.node_rank,
        config.nnodes,
        ranks.start,
        ranks.stop - 1,
        config.master_addr,
        port,
    )
    for p in procs:
        p.join()
    failed = [p.pid for p in procs if p.exitcode != 0]
    if failed:
        logger.error("worker(s) %s exited with an error", failed)
    return 1 if failed else 0


class MultiprocExecutor:
    """Node 0: rank 0 in this process, the node's other ranks spawned."""

    def __init__(self, config: Any, load: Callable, device: torch.device) -> None:
        if config.node_rank != 0:
            raise ValueError("the engine runs on node 0; other nodes run run_worker_node")
        if in_group():
            # This process is rank 0 of a group already (the parallel state is per process).
            raise ValueError(
                "this process already runs a --parallel engine: one parallel model (version) "
                "per server process; serve other models or versions from their own server"
            )
        ranks = node_ranks(config)
        port = rendezvous_port(config)
        self.procs = _spawn(ranks[1:], port, config, load, device)
        try:
            dev = _join(0, config, port, device)
            self.loaded = load(config)
            self.runner = ModelRunner.for_engine(self.loaded, config, dev)
        except BaseException:
            for p in self.procs:
                p.kill()
            destroy_parallel()
            raise
        logger.info(
            "tp=%d pp=%d ep=%d: %d ranks over %d node(s) (%s)",
            config.tensor_parallel,
            config.pipeline_parallel,
            config.expert_parallel,
            world_size(config),
            config.nnodes,
            distributed_backend(device),
        )

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        dead = [p.pid for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"parallel worker(s) {dead} died")
        broadcast_object(out)
        return self.runner.execute(out)

    @staticmethod
    def is_engine_fault(exc: BaseException) -> bool:
        """Every failure is the group's: the ranks may have left a collective unmatched, so
        the engine restarts (new workers) instead of retrying a step on a broken group."""
        return True

    def shutdown(self) -> None:
        if all(p.is_alive() for p in self.procs):
            broadcast_object(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():  # stuck in a collective with a dead peer
                p.kill()
                p.join(timeout=5)
        destroy_parallel()
