"""`--parallel auto`: plan for this machine (a probed profile) among the grids dsinfer can run —
one replica of TP × PP (× EP) — and return (tp, pp, ep)."""

from __future__ import annotations

import logging
import os

from dsinfer.planner.cost_model import Plan, Workload, estimate
from dsinfer.planner.model_shape import model_shape
from dsinfer.planner.planner import divisors
from dsinfer.planner.probe import probe
from dsinfer.planner.profiles import profile_from_dict

logger = logging.getLogger(__name__)


def runnable_plans(shape, devices: int) -> list[Plan]:  # noqa: ANN001
    """Every grid dsinfer executes on up to `devices` ranks: pp stages of `width` ranks, with
    tensor parallel, expert parallel (MoE) or both spanning a stage; one replica."""
    plans = []
    for world in range(1, devices + 1):
        for pp in (d for d in divisors(world) if d <= shape.num_layers):
            width = world // pp
            if width == 1:
                plans.append(Plan(1, pp, 1))
                continue
            heads_split = shape.num_heads % width == 0 and (
                shape.latent_kv or shape.num_kv_heads % width == 0
            )
            experts_split = shape.num_experts and shape.num_experts % width == 0
            if heads_split:
                plans.append(Plan(width, pp, 1))
            if experts_split:
                plans.append(Plan(1, pp, 1, width))
            if heads_split and experts_split:
                plans.append(Plan(width, pp, 1, width))
    return plans


def choose_parallel(model: str, devices: int | None = None, batch: int = 8) -> tuple[int, int, int]:
    """Probe this machine, predict every runnable plan, return the fastest (tp, pp, ep)."""
    from dsinfer.models.loader import read_model_config, resolve_model_path

    devices = devices or os.cpu_count() or 1
    shape = model_shape(read_model_config(resolve_model_path(model, config_only=True)), model)
    profile = profile_from_dict(probe())
    work = Workload(context=2048, batch=batch)
    scored = sorted(
        ((estimate(shape, p, profile, work), p) for p in runnable_plans(shape, devices)),
        key=lambda ep: ep[0].tpot_s,
    )
    best = next((p for e, p in scored if e.fits), Plan(1, 1, 1))
    logger.info(
        "--parallel auto: %s (predicted TPOT %s)",
        best,
        ", ".join(f"{p}: {e.tpot_s * 1e3:.1f} ms" for e, p in scored),
    )
    return best.tp, best.pp, best.ep
