"""Set-once tensor-parallel state of this process (rank and size), read by the layers.

It is set before the model is built (each rank builds only its shard), and never changes.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class ParallelState:
    """This process's place in tensor, pipeline and expert parallel (at most one of the three
    is above 1: a grid of them needs sub-groups, not built yet)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

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


_state = ParallelState()


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the group's rendezvous point)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_tp() -> ParallelState:
    return _state


def init_parallel(
    rank: int, tp: int, pp: int, port: int, ep: int = 1, backend: str = "gloo"
) -> None:
    """Join the group on 127.0.0.1:port (all ranks of one host); set this rank's state."""
    global _state
    if _state != ParallelState():
        raise RuntimeError("parallel state is already set in this process")
    if sum(n > 1 for n in (tp, pp, ep)) > 1:
        raise ValueError("combining tensor, pipeline and expert parallel is not built yet")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp * pp * ep
    )
    _state = ParallelState(rank % tp, tp, rank // tp % pp, pp, rank % ep, ep)


def destroy_parallel() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()
