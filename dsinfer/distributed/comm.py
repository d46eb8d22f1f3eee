"""Collectives inside a pipeline stage (its TP/EP ranks); identities for one rank per stage."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsinfer.distributed.parallel_state import parallel_state, stage_group


def _sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the stage's ranks (fp32 on the wire: gloo has no bf16 reduction)."""
    if x.dtype in (torch.float32, torch.float64):
        dist.all_reduce(x, group=stage_group())
        return x
    wide = x.float()
    dist.all_reduce(wide, group=stage_group())
    return wide.to(x.dtype)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group (row-parallel outputs, vocabulary-parallel embeddings)."""
    return x if parallel_state().tp_size == 1 else _sum(x)


def all_reduce_stage(x: torch.Tensor) -> torch.Tensor:
    """Sum the partial MoE outputs of the stage's ranks (experts placed or sliced over it)."""
    return x if parallel_state().width == 1 else _sum(x)


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """[N, V/tp] on each TP rank → [N, V], rank order along the last dimension."""
    n = parallel_state().tp_size
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=stage_group())
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's object on every rank (the step's SchedulerOutput)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def share_with_stage(obj: Any = None) -> Any:
    """The first stage's local rank 0 object on every rank of that stage (the driver's sampled
    tokens, for the split MTP layer); the object itself when the stage is one rank."""
    state = parallel_state()
    if state.width == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=state.global_rank(state.pp_rank, 0), group=stage_group())
    return box[0]
