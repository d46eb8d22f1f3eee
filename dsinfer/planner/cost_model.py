"""Predicted memory and time of one parallel plan (TP × PP × DP, × EP for MoE) on a profile.

Decode is modelled per step of `batch` sequences at `context` tokens: each device's time is the
larger of its matmul FLOPs over achievable FLOP/s and the bytes it reads (its weight shard —
for MoE, only the experts a step's tokens select — plus its KV) over achievable bandwidth;
tensor parallel adds two all-reduces per layer, expert parallel an all-to-all dispatch and
combine per MoE layer, pipeline parallel a send per stage boundary. Prefill is FLOP-bound:
weights and the attention's L² term. Every number is a formula of the profile and the shape,
so a prediction can be checked against a measurement (docs/parallel.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsinfer.planner.model_shape import WEIGHT_BYTES, ModelShape
from dsinfer.planner.profiles import DeviceProfile, Link

RUNTIME_OVERHEAD = 2 * 1024**3  # CUDA/NPU context, allocator slack, graphs (per device)
CPU_RUNTIME_OVERHEAD = 400 * 1024**2  # a torch process on CPU
ACT_DTYPE_BYTES = 2
MAX_BATCHED_TOKENS = 2048  # the scheduler's per-step token budget (activation memory)


@dataclass(frozen=True, slots=True)
class Plan:
    tp: int
    pp: int
    dp: int
    ep: int = 1

    @property
    def devices(self) -> int:
        # An EP group wider than TP × DP (dsinfer's ep=K with tp=1) replicates attention over
        # its ranks: they are devices too.
        return self.pp * max(self.tp * self.dp, self.ep)

    def __str__(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp}" + (f",ep={self.ep}" if self.ep > 1 else "")


@dataclass(frozen=True, slots=True)
class Workload:
    context: int = 4096
    batch: int = 16  # concurrent sequences over the whole deployment
    weight_dtype: str = "bfloat16"
    compute_dtype: str = "bfloat16"


@dataclass(frozen=True, slots=True)
class Estimate:
    plan: Plan
    memory_per_device: float
    fits: bool
    prefill_s: float
    tpot_s: float  # time per output token of one sequence
    throughput: float  # output tokens/s of the deployment
    breakdown: dict[str, float]


def _all_reduce(bytes_: float, n: int, link: Link, eff: float) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * bytes_ / (link.bandwidth * eff) + 2 * (n - 1) * link.latency


def _all_to_all(bytes_: float, n: int, link: Link, eff: float) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) / n * bytes_ / (link.bandwidth * eff) + (n - 1) * link.latency


def _busiest_share(experts: int, touched: float, ep: int) -> float:
    """Expected experts touched on the busiest of `ep` ranks holding experts/ep each. A rank's
    count is hypergeometric (`touched` of `experts` drawn without replacement, 1/ep of them
    its own); the maximum over the ranks is approximated as mean + c·σ (c: the expected
    maximum of `ep` standard normals)."""
    per, q = experts / ep, 1 / ep
    mean = touched * q
    var = touched * q * (1 - q) * (experts - touched) / max(1, experts - 1)
    c = {1: 0.0, 2: 0.564, 4: 1.029, 8: 1.424}.get(ep, math.sqrt(2 * math.log(ep)))
    return min(per, mean + c * math.sqrt(max(0.0, var)))


def _link(group: int, profile: DeviceProfile, inner: int = 1) -> Link:
    """The link a group of `group` ranks laid out with stride `inner` uses."""
    return profile.intra_node if group * inner <= profile.devices_per_node else profile.inter_node


def estimate(shape: ModelShape, plan: Plan, profile: DeviceProfile, work: Workload) -> Estimate:
    wb = WEIGHT_BYTES[work.weight_dtype]
    flops = profile.flops_for(work.compute_dtype) * profile.eff("compute")
    bw = profile.memory_bandwidth * profile.eff("memory")
    capacity = profile.memory_bytes
    if profile.shared_host:  # CPU "devices" are processes: they share the bandwidth and RAM
        bw /= plan.devices
        if profile.device_bandwidth:  # … and one alone cannot use all of it
            bw = min(bw, profile.device_bandwidth * profile.eff("memory"))
        if profile.concurrent_bandwidth and plan.devices > 1:  # … nor two busy at once
            pair = 2 * profile.concurrent_bandwidth * profile.eff("memory")
            bw = min(bw, pair / plan.devices)
        capacity /= plan.devices
    link_eff = profile.eff("link")
    shards = plan.tp * plan.pp
    # Memory: weights (experts split over the EP group and the stages), KV, activations.
    dense_w = shape.dense_params * wb / shards
    # Experts are placed whole over the EP group, or (no EP) each sliced over the TP group.
    expert_split = plan.ep if plan.ep > 1 else plan.tp
    expert_w = shape.expert_params * wb / (expert_split * plan.pp)
    seqs = max(1, work.batch // plan.dp)  # sequences one replica holds
    kv_split = plan.pp * (1 if shape.latent_kv else min(plan.tp, shape.num_kv_heads))
    kv = shape.kv_bytes_per_token * work.context * seqs / kv_split
    act = MAX_BATCHED_TOKENS * shape.hidden * ACT_DTYPE_BYTES * 16 / plan.tp
    overhead = CPU_RUNTIME_OVERHEAD if profile.shared_host else RUNTIME_OVERHEAD
    mem = dense_w + expert_w + kv + act + overhead
    # Decode step of one replica: `seqs` tokens through the model.
    layers_per_stage = shape.num_layers / plan.pp
    e, k = shape.num_experts, shape.experts_per_token
    touched = e * (1 - (1 - k / e) ** seqs) if e else 0  # experts one step selects, per layer
    # Experts one device runs per MoE layer: whole ones of its EP share — the busiest rank's,
    # which the step waits for — or, sliced by TP, a slice of every touched expert.
    runs = _busiest_share(e, touched, plan.ep) if plan.ep > 1 else touched
    expert_read = runs * shape.moe_layers * shape.expert_params_per_layer_expert * wb
    expert_read *= plan.ep / expert_split  # TP slices: a 1/tp part of each
    read = shape.body_params * wb / shards
    read += expert_read / plan.pp + kv
    # The LM head: split over TP (vocabulary parallel), on the first stage only — read once
    # per step, spread here over the stages whose times add up to TPOT.
    read += shape.head_params * wb / shards
    active = shape.active_params()
    compute = 2 * active * seqs / shards / flops
    compute += 4 * shape.num_layers * shape.hidden * work.context * seqs / shards / flops  # attn
    memory = read / bw
    tp_link = _link(plan.tp, profile)
    tp_comm = (
        layers_per_stage * 2 * _all_reduce(seqs * shape.hidden * 2, plan.tp, tp_link, link_eff)
    )
    ep_link = _link(plan.ep, profile)
    moe_per_stage = shape.moe_layers / plan.pp
    if plan.dp > 1:
        # DP attention: replicas hold different tokens, which travel to their experts' ranks
        # and back (an all-to-all dispatch and combine per MoE layer).
        ep_bytes = 2 * seqs * k * shape.hidden * 2 / max(1, plan.ep)
        ep_comm = moe_per_stage * 2 * _all_to_all(ep_bytes * plan.ep, plan.ep, ep_link, link_eff)
    elif plan.ep > plan.tp:
        # One replica, attention replicated over the EP ranks: every rank has every token, and
        # one all-reduce per MoE layer sums the experts' partial outputs.
        ep_comm = moe_per_stage * _all_reduce(seqs * shape.hidden * 2, plan.ep, ep_link, link_eff)
    else:
        ep_comm = 0.0  # EP spans the TP ranks: the MLP's TP all-reduce sums the experts too
    # Fixed host costs, serial with the kernels on CPU (0 in accelerator profiles): per layer
    # (TP slices a layer's work, not its dispatch) and per routed expert run.
    dispatch = layers_per_stage * profile.layer_overhead
    dispatch += moe_per_stage * runs * profile.expert_overhead
    stage = max(compute, memory) + dispatch + tp_comm + ep_comm  # one device = one stage
    pp_link = _link(plan.pp, profile, plan.tp)
    hop = seqs * shape.hidden * 2 / (pp_link.bandwidth * link_eff) + pp_link.latency
    tpot = plan.pp * stage + (plan.pp - 1) * hop
    # Decode is bound by reading each stage's weights once per step whatever the micro-batching,
    # so pipeline stages add capacity (memory), not rate: each replica emits `seqs` per TPOT.
    throughput = plan.dp * seqs / tpot
    # Prefill of one `context`-token prompt (FLOP-bound), TP all-reduces over its activations.
    pre_flops = 2 * active * work.context + 4 * shape.num_layers * shape.hidden * work.context**2
    prefill = pre_flops / plan.tp / flops
    prefill += (
        shape.num_layers
        * 2
        * _all_reduce(work.context * shape.hidden * 2, plan.tp, tp_link, link_eff)
    )
    prefill += (plan.pp - 1) * (work.context * shape.hidden * 2 / (pp_link.bandwidth * link_eff))
    return Estimate(
        plan,
        mem,
        mem <= capacity,
        prefill,
        tpot,
        throughput,
        {
            "weights_gb": (dense_w + expert_w) / 1e9,
            "kv_gb": kv / 1e9,
            "compute_ms": compute * 1e3,
            "memory_ms": memory * 1e3,
            "tp_comm_ms": tp_comm * 1e3,
            "ep_comm_ms": ep_comm * 1e3,
            "dispatch_ms": dispatch * 1e3,
        },
    )
