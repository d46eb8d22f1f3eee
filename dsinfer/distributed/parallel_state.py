"""Set-once tensor-parallel state of this process (rank and size), read by the layers.

It is set before the model is built (each rank builds only its shard), and never changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class ParallelState:
    """This process's place: tensor-parallel rank/size and pipeline stage/stages (one of the
    two is 1 for now: a TP × PP grid needs sub-groups, not built yet)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def stage_layers(self, num_layers: int) -> range:
        """Decoder layers this pipeline stage owns (contiguous; the last stage may own fewer)."""
        per = -(-num_layers // self.pp_size)
        return range(self.pp_rank * per, min(num_layers, (self.pp_rank + 1) * per))


_state = ParallelState()


def get_tp() -> ParallelState:
    return _state


def init_parallel(rank: int, tp: int, pp: int, port: int, backend: str = "gloo") -> None:
    """Join the group on 127.0.0.1:port (all ranks of one host); set this rank's state."""
    global _state
    if _state.tp_size != 1 or _state.pp_size != 1:
        raise RuntimeError("parallel state is already set in this process")
    if tp > 1 and pp > 1:
        raise ValueError("tensor and pipeline parallel together are not built yet")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp * pp
    )
    _state = ParallelState(rank % tp, tp, rank // tp, pp)


def destroy_parallel() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()
