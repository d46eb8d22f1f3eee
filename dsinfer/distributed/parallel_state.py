"""Set-once tensor-parallel state of this process (rank and size), read by the layers.

It is set before the model is built (each rank builds only its shard), and never changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1


_state = ParallelState()


def get_tp() -> ParallelState:
    return _state


def init_tensor_parallel(rank: int, size: int, port: int, backend: str = "gloo") -> None:
    """Join the group on 127.0.0.1:port (all ranks of one host); set this rank's state."""
    global _state
    if _state.tp_size != 1:
        raise RuntimeError("tensor-parallel state is already set in this process")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    _state = ParallelState(rank, size)


def destroy_tensor_parallel() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()
