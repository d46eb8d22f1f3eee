"""The cost-model planner: shapes counted from the real graph, plans that fit or are refused
with the reason, the choice is the best prediction, profiles load, probe measures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsinfer.cli import main
from dsinfer.models.registry import config_from_hf
from dsinfer.planner.cost_model import Plan, Workload, estimate
from dsinfer.planner.model_shape import model_shape
from dsinfer.planner.planner import candidate_plans, plan
from dsinfer.planner.profiles import builtin_names, load_profile

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"


def _shape(name: str):  # noqa: ANN202
    cfg = config_from_hf(json.loads((CONFIGS / name / "config.json").read_text()))
    return model_shape(cfg, name)


def test_shapes_match_published_parameter_counts():
    v3, lite = _shape("deepseek-v3"), _shape("deepseek-v2-lite")
    assert abs((v3.dense_params + v3.expert_params) / 1e9 - 671) < 1  # DeepSeek: 671 B
    assert abs(v3.active_params() / 1e9 - 37) < 1  # 37 B activated per token
    assert abs((lite.dense_params + lite.expert_params) / 1e9 - 15.7) < 0.1  # 15.7 B
    assert abs(lite.active_params() / 1e9 - 2.4) < 0.1  # 2.4 B activated
    assert v3.latent_kv and v3.kv_bytes_per_token == 61 * (512 + 64) * 2


def test_candidates_cover_the_devices_and_respect_divisibility():
    v3 = _shape("deepseek-v3")
    plans = candidate_plans(v3, 16)
    assert plans and all(p.devices == 16 for p in plans)
    assert all(128 % p.tp == 0 and 256 % p.ep == 0 and p.ep <= p.tp * p.dp for p in plans)
    assert Plan(8, 2, 1, 8) in plans and Plan(1, 1, 16, 16) in plans


def test_choice_is_the_best_fitting_prediction_and_misfits_say_why():
    v3 = _shape("deepseek-v3")
    work = Workload(context=4096, batch=64, weight_dtype="fp8")
    for objective in ("latency", "throughput"):
        report = plan(v3, 8, load_profile("h200"), work, objective)
        assert report.chosen is not None and report.chosen.fits
        best = min(
            report.ranked, key=lambda e: e.tpot_s if objective == "latency" else -e.throughput
        )
        assert best.plan == report.chosen.plan
        assert report.refused and all("GB per device" in why for _e, why in report.refused)
    e = estimate(v3, Plan(8, 1, 1, 8), load_profile("h200"), work)
    assert abs(e.breakdown["weights_gb"] - 671.0 / 8) < 0.5  # each rank holds only its shard


def test_refuses_when_nothing_fits(capsys):
    argv = ["plan", "--model", str(CONFIGS / "deepseek-v3"), "--devices", "8", "--profile", "h200"]
    assert main([*argv, "--weight-dtype", "bfloat16"]) == 2  # 1.34 TB of bf16 > 8 × 141 GB
    assert "no plan fits" in capsys.readouterr().out
    assert main([*argv, "--weight-dtype", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] and any(not p["fits"] for p in out["plans"])


def test_builtin_profiles():
    assert {"h200", "a100", "ascend-910b"} <= set(builtin_names())
    for name in builtin_names():
        p = load_profile(name)
        assert p.memory_bytes > 0 and p.flops["bfloat16"] > 0 and p.sources
    with pytest.raises(ValueError, match="unknown device profile"):
        load_profile("tpu-v9")


@pytest.mark.slow  # the probe measures for ~10 s (memory, GEMMs, a link between processes)
def test_probe_then_plan_for_this_machine(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert main(["probe", "-o", str(out)]) == 0
    probed = load_profile(str(out))
    assert probed.shared_host and probed.memory_bandwidth > 1e9 and probed.flops["float32"] > 1e9
    capsys.readouterr()
    # SmolLM2 has 9 heads: tensor parallel 2 is impossible; the planner says dp or pp.
    assert main(["plan", "--model", "smollm2", "--devices", "2", "--profile", str(out)]) == 0
    assert "tp=2" not in capsys.readouterr().out
    # More single-threaded ranks than this host's cores: refused, not predicted.
    many = str(probed.devices_per_node + 1)
    assert main(["plan", "--model", "smollm2", "--devices", many, "--profile", str(out)]) == 2
    assert "cores" in capsys.readouterr().err
