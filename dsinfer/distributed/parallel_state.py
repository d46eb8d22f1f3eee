"""Set-once parallel state of this process (its place in the TP × PP × EP grid), read by layers.

It is set before the model is built (each rank builds only its shard), and never changes.

Layout: the world is `pp` stages of `width` ranks each, rank = stage · width + local. Inside a
stage, tensor parallel and expert parallel span the same ranks (each is 1 or the stage width):
attention heads, MLP columns and the vocabulary split over the stage (tp = width), routed
experts are placed over it (ep = width) or, without EP, sliced like any MLP. So one group per
stage carries every intra-stage collective, and stage-to-stage sends pair equal local ranks.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# A collective waits this long for a missing rank before it raises (a dead worker on another
# node, where its exit cannot be observed directly): the step fails instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def check_grid(tp: int, pp: int, ep: int) -> int:
    """Validate a TP × PP × EP request; return the world size (ranks)."""
    for name, n in (("tp", tp), ("pp", pp), ("ep", ep)):
        if n < 1:
            raise ValueError(f"--parallel {name}={n}: sizes are positive integers")
    width = max(tp, ep)
    if tp not in (1, width) or ep not in (1, width):
        raise ValueError(
            f"--parallel tp={tp},ep={ep}: expert parallel spans the tensor-parallel ranks of a "
            f"stage, so give ep=1, ep={tp} (= tp), or tp=1"
        )
    return width * pp


@dataclass(frozen=True, slots=True)
class ParallelState:
    """This process's place in tensor, pipeline and expert parallel."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def width(self) -> int:
        """Ranks per pipeline stage."""
        return max(self.tp_size, self.ep_size)

    @property
    def world(self) -> int:
        return self.width * self.pp_size

    @property
    def local_rank(self) -> int:
        """Index inside the stage (the TP rank, or the EP rank when tp = 1)."""
        return max(self.tp_rank, self.ep_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def global_rank(self, stage: int, local: int | None = None) -> int:
        """The rank at `local` (default: this one's) of pipeline stage `stage`."""
        return stage * self.width + (self.local_rank if local is None else local)

    def stage_layers(self, num_layers: int) -> range:
        """Decoder layers this pipeline stage owns (contiguous; the last stage may own fewer)."""
        per = -(-num_layers // self.pp_size)
        return range(self.pp_rank * per, min(num_layers, (self.pp_rank + 1) * per))

    def expert_range(self, num_experts: int) -> range:
        """Routed experts this expert-parallel rank holds (contiguous, equal shares)."""
        if num_experts % self.ep_size:
            raise ValueError(
                f"{num_experts} routed experts do not split over {self.ep_size} EP ranks"
            )
        per = num_experts // self.ep_size
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    @property
    def expert_slices(self) -> int:
        """How many ways each routed expert's intermediate dimension is cut: TP without EP."""
        return self.tp_size if self.ep_size == 1 else 1

    @staticmethod
    def of_rank(rank: int, tp: int, pp: int, ep: int) -> ParallelState:
        width = check_grid(tp, pp, ep) // pp
        stage, local = divmod(rank, width)
        return ParallelState(local if tp > 1 else 0, tp, stage, pp, local if ep > 1 else 0, ep)


_state = ParallelState()
_stage_group: Any = None  # this stage's process group (None: the world, or one process)


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the group's rendezvous point)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parallel_state() -> ParallelState:
    """This process's place in the TP × PP × EP grid (set once by init_parallel)."""
    return _state


def in_group() -> bool:
    """Whether this process already holds a rank (the state is set once per process)."""
    return _state != ParallelState()


def stage_group() -> Any:
    """The group of this pipeline stage's ranks (TP and EP collectives)."""
    return _stage_group


def init_parallel(
    rank: int,
    tp: int,
    pp: int,
    port: int,
    ep: int = 1,
    backend: str = "gloo",
    master_addr: str = "127.0.0.1",
) -> None:
    """Join the group at master_addr:port; set this rank's state and its stage's group."""
    global _state, _stage_group
    if in_group():
        raise RuntimeError("parallel state is already set in this process")
    state = ParallelState.of_rank(rank, tp, pp, ep)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{port}",
        rank=rank,
        world_size=state.world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    if pp > 1 and state.width > 1:
        # Every rank creates every stage's group, in the same order (torch's rule).
        groups = [
            dist.new_group([state.global_rank(s, i) for i in range(state.width)]) for s in range(pp)
        ]
        _stage_group = groups[state.pp_rank]
    _state = state


def destroy_parallel() -> None:
    global _state, _stage_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()
    _stage_group = None
