"""Enumerate TP × PP × DP (× EP) plans for N devices, predict each, choose by the objective."""

from __future__ import annotations

from dataclasses import dataclass

from dsinfer.planner.cost_model import Estimate, Plan, Workload, estimate
from dsinfer.planner.model_shape import ModelShape
from dsinfer.planner.profiles import DeviceProfile


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_plans(shape: ModelShape, devices: int) -> list[Plan]:
    plans = []
    for tp in divisors(devices):
        if shape.num_heads % tp:
            continue  # heads split evenly over TP ranks
        for pp in divisors(devices // tp):
            if pp > shape.num_layers:
                continue
            dp = devices // (tp * pp)
            eps = [1]
            if shape.num_experts:
                eps = [ep for ep in divisors(tp * dp) if shape.num_experts % ep == 0]
            plans += [Plan(tp, pp, dp, ep) for ep in eps]
    return plans


@dataclass(frozen=True, slots=True)
class PlanReport:
    chosen: Estimate | None
    ranked: list[Estimate]  # fitting plans, best first
    refused: list[tuple[Estimate, str]]  # plans that do not fit, with the reason
    objective: str

    def reason_lost(self, e: Estimate) -> str:
        best = self.chosen
        assert best is not None
        if self.objective == "latency":
            return f"TPOT {e.tpot_s * 1e3:.1f} ms vs {best.tpot_s * 1e3:.1f} ms"
        return f"{e.throughput:,.0f} tok/s vs {best.throughput:,.0f} tok/s"


def _key(e: Estimate, objective: str) -> tuple[float, float]:
    if objective == "latency":
        return (e.tpot_s, -e.throughput)
    return (-e.throughput, e.tpot_s)


def plan(
    shape: ModelShape,
    devices: int,
    profile: DeviceProfile,
    work: Workload,
    objective: str = "throughput",
) -> PlanReport:
    if objective not in ("latency", "throughput"):
        raise ValueError(f"--objective must be latency or throughput, not {objective!r}")
    if devices < 1:
        raise ValueError("--devices must be at least 1")
    estimates = [estimate(shape, p, profile, work) for p in candidate_plans(shape, devices)]
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: _key(e, objective))
    refused = [
        (
            e,
            f"needs {e.memory_per_device / 1e9:.1f} GB per device "
            f"(weights {e.breakdown['weights_gb']:.1f}, KV {e.breakdown['kv_gb']:.1f}) > "
            f"{profile.memory_bytes / (devices if profile.shared_host else 1) / 1e9:.1f} GB",
        )
        for e in estimates
        if not e.fits
    ]
    return PlanReport(fitting[0] if fitting else None, fitting, refused, objective)


def format_report(report: PlanReport, shape: ModelShape, devices: int, top: int = 4) -> str:
    lines = [f"{shape.name} on {devices} devices, objective {report.objective}:"]
    if report.chosen is None:
        lines.append("no plan fits:")
        lines += [f"  {e.plan}: {why}" for e, why in report.refused[:top]]
        lines.append("use more devices, a smaller weight dtype (--weight-dtype), or less context")
        return "\n".join(lines)
    c = report.chosen
    lines.append(
        f"chosen {c.plan}: TPOT {c.tpot_s * 1e3:.1f} ms, {c.throughput:,.0f} tok/s, "
        f"prefill {c.prefill_s:.2f} s, {c.memory_per_device / 1e9:.1f} GB per device"
    )
    b = c.breakdown
    lines.append(
        f"  step: compute {b['compute_ms']:.2f} ms, memory {b['memory_ms']:.2f} ms, "
        f"TP comm {b['tp_comm_ms']:.2f} ms, EP comm {b['ep_comm_ms']:.2f} ms"
    )
    for e in report.ranked[1:top]:
        lines.append(f"  next {e.plan}: lost on {report.reason_lost(e)}")
    for e, why in report.refused[:top]:
        lines.append(f"  refused {e.plan}: {why}")
    return "\n".join(lines)
