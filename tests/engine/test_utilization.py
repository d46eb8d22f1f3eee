"""MBU/MFU accounting on a known shape (docs/metrics.md has the formulas)."""

from __future__ import annotations

import dataclasses

import pytest

from dsinfer.engine.utilization import StepModel, UtilizationMeter

DENSE = StepModel(
    weight_bytes=1000, embedding_row_bytes=10, expert_bytes=0, num_experts=0,
    experts_per_token=0, moe_layers=0, active_params=500, kv_bytes_per_token=100,
    attention_width=2,
)  # fmt: skip


def test_step_bytes_and_flops_by_hand():
    # A decode at context 9 and a 4-token prefill chunk at context 0.
    moved, flops = DENSE.cost([(1, 9), (4, 0)])
    # weights 1000 + 5 embedding rows 50 + KV read 9 × 100 + KV written 5 × 100
    assert moved == 1000 + 50 + 900 + 500
    # 2 × 500 × 5 tokens; attention 4 × 2 × (1 × (9 + 1)) + 4 × 2 × (4 × (0 + 2.5))
    assert flops == 5000 + 80 + 80
    assert DENSE.cost([]) == (0.0, 0.0)


def test_routed_experts_count_the_ones_tokens_touch():
    moe = dataclasses.replace(
        DENSE, expert_bytes=7, num_experts=4, experts_per_token=2, moe_layers=3
    )
    one, _ = moe.cost([(1, 0)])
    # One token touches its 2 of 4 experts in each of 3 layers: 3 × 2 × 7 bytes.
    assert one - DENSE.cost([(1, 0)])[0] == pytest.approx(42)
    many, _ = moe.cost([(64, 0)])
    assert many - DENSE.cost([(64, 0)])[0] == pytest.approx(3 * 4 * 7, rel=1e-6)  # all of them


def test_meter_divides_by_busy_time_and_peaks():
    meter = UtilizationMeter(DENSE, peak_bandwidth=9800.0, peak_flops=51600.0)
    assert meter.snapshot().mbu == 0.0  # idle: nothing to report
    meter.record(0.5, [(1, 9), (4, 0)])
    u = meter.snapshot()
    assert u.bandwidth == pytest.approx(2450 / 0.5)
    assert u.mbu == pytest.approx(0.5)
    assert u.mfu == pytest.approx(5160 / 0.5 / 51600)
    assert 0 < u.busy <= 1


def test_step_model_of_a_loaded_model_counts_its_stored_bytes(tmp_path):
    from dsinfer import LLM
    from tests.helpers import tiny_llama_dir

    llm = LLM(str(tiny_llama_dir(tmp_path, num_layers=1)), num_blocks=16, block_size=8)
    model = llm.engine.executor.runner.model
    step = llm.engine.utilization.model
    embed = model.model.embed_tokens.weight
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    assert step.weight_bytes == total - embed.numel() * embed.element_size()
    assert step.embedding_row_bytes == embed.shape[1] * embed.element_size()
    assert step.kv_bytes_per_token == llm.engine.kv_bytes_per_token
    peak_bw = llm.engine.utilization.peak_bandwidth
    assert peak_bw > 1e8  # measured at start-up: more than 100 MB/s on any machine


def test_device_memory_counters_only_where_the_device_has_them():
    import torch

    from dsinfer.device import memory_stats

    assert memory_stats(torch.device("cpu")) is None  # the process collector covers the CPU


def test_bf16_peak_without_native_bf16_gemms_is_the_fp32_gemm_rate(monkeypatch):
    """On a CPU that only emulates bf16 GEMMs (AVX2: ~1 GFLOP/s) the probe measures fp32, the
    fastest float GEMM there (and the one that does not take ~19 s at start-up); where bf16 is
    native it measures bf16 itself."""
    import torch

    import dsinfer.device as device
    from dsinfer.engine import utilization

    measured: list[torch.dtype] = []
    monkeypatch.setattr(utilization, "_probed", {})
    monkeypatch.setattr(utilization, "_gemm_rate", lambda dtype: measured.append(dtype) or 1.0)
    for native, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(device, "native_bf16_matmul", lambda dev, n=native: n)
        utilization._probed.clear()
        utilization.peak_flops(None, torch.bfloat16, "cpu")
        assert measured[-1] == want
