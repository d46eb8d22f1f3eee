"""`--parallel auto`: plan for this machine (a probed profile) among the plans dsinfer can run —
one replica, one kind of parallelism at a time — and return (tp, pp, ep)."""

from __future__ import annotations

import logging
import os

from dsinfer.planner.cost_model import Plan, Workload, estimate
from dsinfer.planner.model_shape import model_shape
from dsinfer.planner.probe import probe
from dsinfer.planner.profiles import profile_from_dict

logger = logging.getLogger(__name__)


def runnable_plans(shape, devices: int) -> list[Plan]:  # noqa: ANN001
    plans = [Plan(1, 1, 1)]
    for n in range(2, devices + 1):
        if shape.num_experts and shape.num_experts % n == 0:
            plans.append(Plan(1, 1, 1, n))  # expert parallel (MoE models)
        elif not shape.num_experts and shape.num_heads % n == 0 and shape.num_kv_heads % n == 0:
            plans.append(Plan(n, 1, 1))
        if not shape.num_experts and n <= shape.num_layers:
            plans.append(Plan(1, n, 1))
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
