"""Honest utilisation: the bytes and FLOPs each engine step had to move and do, over its wall
time, against the machine's peaks (docs/metrics.md has the formulas).

Per step, for the tokens it computed (decodes and prefill chunks alike):
  bytes = W + E(T) + KV_read + KV_write
    W        weight bytes every forward reads (as stored: int4/int8/bf16/fp32), the embedding
             table excepted (a lookup reads T rows of it, counted below)
    E(T)     routed experts: per MoE layer, the experts T tokens are expected to touch,
             n·(1 − (1 − k/n)^T) of n with top-k, times one expert's bytes
    KV_read  Σ over sequences of (context length before the step) × KV bytes per token
    KV_write T × KV bytes per token
  flops = 2 · P_active · T + Σ over sequences of 4 · L · H · D · (new tokens × context)
    P_active the parameters one token multiplies with (routed experts: top-k of them)

MBU = Σ bytes / (Σ step seconds × peak bandwidth), MFU = Σ flops / (Σ step seconds × peak
FLOP/s), both over the steps of the last minute; a machine waiting for work is not counted as
busy (engine_busy_ratio says how much it was).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class StepModel:
    """What a step costs, from the loaded model's shape and storage."""

    weight_bytes: float  # read by every forward (embedding table and routed experts excepted)
    embedding_row_bytes: float
    expert_bytes: float  # one routed expert in one MoE layer
    num_experts: int
    experts_per_token: int
    moe_layers: int
    active_params: float
    kv_bytes_per_token: int
    attention_width: int  # L · H · D: query heads × head dim summed over layers

    def cost(self, seqs: list[tuple[int, int]]) -> tuple[float, float]:
        """(bytes, flops) of one step over (new tokens, context before them) per sequence."""
        tokens = sum(n for n, _ in seqs)
        if tokens == 0:
            return 0.0, 0.0
        experts = 0.0
        if self.num_experts:
            share = self.experts_per_token / self.num_experts
            touched = self.num_experts * (1.0 - (1.0 - share) ** tokens)
            experts = self.moe_layers * touched * self.expert_bytes
        kv_read = sum(ctx for _, ctx in seqs) * self.kv_bytes_per_token
        kv_write = tokens * self.kv_bytes_per_token
        moved = self.weight_bytes + experts + tokens * self.embedding_row_bytes + kv_read + kv_write
        # Attention: QKᵀ and PV, 2 FLOPs a multiply-add each, over the context each new token
        # sees (its own earlier tokens in the chunk included, on average half of them).
        attn = sum(4 * self.attention_width * n * (ctx + (n + 1) / 2) for n, ctx in seqs)
        return moved, 2.0 * self.active_params * tokens + attn


@dataclass(frozen=True, slots=True)
class Utilization:
    mbu: float = 0.0
    mfu: float = 0.0
    bandwidth: float = 0.0  # bytes per busy second
    flops: float = 0.0  # FLOPs per busy second
    busy: float = 0.0  # share of the window spent in steps


class UtilizationMeter:
    """Rolling sums over the last minute of steps; read from the server's thread."""

    def __init__(self, model: StepModel, peak_bandwidth: float, peak_flops: float) -> None:
        self.model = model
        self.peak_bandwidth, self.peak_flops = peak_bandwidth, peak_flops
        self._steps: deque[tuple[float, float, float, float]] = deque()  # end, s, bytes, flops
        self._lock = threading.Lock()
        # Running totals since start (Prometheus counters: rates over any interval).
        self.total_seconds = self.total_bytes = self.total_flops = 0.0

    def record(self, seconds: float, seqs: list[tuple[int, int]]) -> None:
        moved, flops = self.model.cost(seqs)
        now = time.monotonic()
        with self._lock:
            self._steps.append((now, seconds, moved, flops))
            self._trim(now)
            self.total_seconds += seconds
            self.total_bytes += moved
            self.total_flops += flops

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - WINDOW_S:
            self._steps.popleft()

    def snapshot(self) -> Utilization:
        with self._lock:
            self._trim(time.monotonic())
            busy = sum(s for _, s, _, _ in self._steps)
            moved = sum(b for _, _, b, _ in self._steps)
            flops = sum(f for _, _, _, f in self._steps)
        if busy <= 0:
            return Utilization()
        bw, fl = moved / busy, flops / busy
        return Utilization(
            mbu=bw / self.peak_bandwidth if self.peak_bandwidth else 0.0,
            mfu=fl / self.peak_flops if self.peak_flops else 0.0,
            bandwidth=bw,
            flops=fl,
            busy=min(1.0, busy / WINDOW_S),
        )


def step_model(model, config, kv_bytes_per_token: int) -> StepModel:  # noqa: ANN001
    """StepModel of a loaded nn.Module: bytes as its tensors are stored, FLOPs from the shape."""
    from dsinfer.planner.model_shape import model_shape

    shape = model_shape(config)
    weight = embed = experts = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        size = t.numel() * t.element_size()
        if "embed_tokens" in name:
            embed += size
        elif ".experts." in name:
            experts += size
        elif "rotary" not in name and "cos_sin" not in name and "inv_freq" not in name:
            weight += size
    n_exp = shape.num_experts
    return StepModel(
        weight_bytes=float(weight),
        embedding_row_bytes=embed / max(1, config.vocab_size),
        expert_bytes=experts / max(1, shape.moe_layers * n_exp) if n_exp else 0.0,
        num_experts=n_exp,
        experts_per_token=shape.experts_per_token,
        moe_layers=shape.moe_layers,
        active_params=float(shape.active_params()),
        kv_bytes_per_token=kv_bytes_per_token,
        attention_width=config.num_layers * config.num_heads * config.head_dim,
    )


_probed: dict[str, float] = {}  # "bandwidth" and one entry per dtype: measured once a process
_probe_lock = threading.Lock()


def _profile(profile: str | None, device_type: str):  # noqa: ANN202
    """The device profile peaks come from: the one given, the device type's built-in one off
    CPU, or None (this CPU is measured)."""
    from dsinfer.planner.profiles import load_profile

    if profile is not None:
        return load_profile(profile)
    if device_type != "cpu":
        return load_profile({"cuda": "h200", "npu": "ascend-910b"}.get(device_type, "h200"))
    return None


def peak_bandwidth(profile: str | None, device_type: str) -> float:
    """Peak bytes/s: from the profile, else a 2 × 48 MiB copy on this CPU (once a process;
    call it before a model loads, so its buffers never add to the peak memory)."""
    p = _profile(profile, device_type)
    if p is not None:
        return p.memory_bandwidth
    return _measured("bandwidth", _copy_rate)


def peak_flops(profile: str | None, dtype, device_type: str) -> float:  # noqa: ANN001
    """Peak FLOP/s at `dtype` (the dtype the model runs in): from the profile, else a 1024²
    GEMM on this CPU (once a process and dtype)."""
    name = str(dtype).removeprefix("torch.")
    p = _profile(profile, device_type)
    if p is not None:
        return p.flops_for(name)
    import torch

    from dsinfer.device import native_bf16_matmul

    if dtype == torch.bfloat16 and not native_bf16_matmul(torch.device(device_type)):
        # Without native bf16 GEMMs (AVX2 CPUs) torch emulates them at ~1 GFLOP/s: the probe
        # took 19 s at start-up, and no kernel of ours runs at that rate (bf16 activations
        # meet int4/int8 weights in our kernels, in integer or fp32 arithmetic). The fastest
        # float GEMM the machine has, fp32, is its peak.
        dtype, name = torch.float32, "float32"
    return _measured(name, lambda: _gemm_rate(dtype))


def _measured(key: str, measure) -> float:  # noqa: ANN001
    with _probe_lock:
        if key not in _probed:
            _probed[key] = measure()
        return _probed[key]


def _best(fn) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _copy_rate() -> float:
    from dsinfer.device.host_memory import copy_buffers

    src, dst = copy_buffers(48 << 20)  # 2 × 48 MiB: past any L3 share
    return 2 * src.nbytes / _best(lambda: dst.copy_(src))  # read + write


def _gemm_rate(dtype) -> float:  # noqa: ANN001
    import torch

    n = 1024
    # Drawn in the dtype itself: no float32 copies (it runs with the KV pool already resident,
    # so its transients count toward the server's peak memory).
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / _best(lambda: torch.mm(a, b, out=out))
