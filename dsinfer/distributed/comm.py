"""Collectives for tensor parallel; no-ops for one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsinfer.distributed.parallel_state import get_tp


def _sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the world (fp32 on the wire: gloo has no bf16 reduction)."""
    if x.dtype in (torch.float32, torch.float64):
        dist.all_reduce(x)
        return x
    wide = x.float()
    dist.all_reduce(wide)
    return wide.to(x.dtype)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group (the world, while parallel kinds are not combined)."""
    return x if get_tp().tp_size == 1 else _sum(x)


def all_reduce_ep(x: torch.Tensor) -> torch.Tensor:
    """Sum the expert-parallel ranks' partial MoE outputs (the world, likewise)."""
    return x if get_tp().ep_size == 1 else _sum(x)


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's object on every rank (the step's SchedulerOutput)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
