"""Fixed per-step costs that do not scale with the weights: the host time to dispatch one
decoder layer's operators (Python, the paged-attention bookkeeping, kernel launches) and one
routed expert's, measured on dsinfer's own layers at toy widths so that what remains is the
overhead. On CPU they add to every step; on GPUs graphs and asynchronous launches hide most of
them (the datasheet profiles leave them at zero). A per-matmul intercept (time against weight
bytes, cold weights) was measured too and found indistinguishable from zero here.
"""

from __future__ import annotations

import time

import torch

from dsinfer.config import CacheConfig
from dsinfer.layers.moe import MoEConfig, RoutedExperts
from dsinfer.models.loader import LoadedModel, build_model, fill_random_weights
from dsinfer.models.registry import config_from_hf
from dsinfer.worker.model_runner import ModelRunner
from dsinfer.worker.step_io import NewRequestData, ScheduledSeq, SchedulerOutput

_TOY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def _decode_step_time(layers: int, dtype: torch.dtype, steps: int = 30) -> float:
    """Seconds per batch-1 decode step of a toy Llama with `layers` layers (best of runs)."""
    from dsinfer.sampling import SamplingParams

    cfg = config_from_hf({**_TOY, "num_hidden_layers": layers})
    net = build_model(cfg, dtype, "cpu")
    fill_random_weights(net, 0)
    loaded = LoadedModel(net, cfg, None, dtype)  # type: ignore[arg-type]
    runner = ModelRunner(loaded, CacheConfig(block_size=16, num_blocks=8), torch.device("cpu"))
    params = SamplingParams(temperature=0, max_tokens=steps + 2)
    prompt = list(range(1, 17))
    runner.execute(
        SchedulerOutput(
            [ScheduledSeq("p", prompt, 0, [0, 1, 2, 3], True, prompt_len=16)],
            [NewRequestData("p", prompt, params)],
        )
    )
    best = float("inf")
    for pos in range(16, 16 + steps):
        out = SchedulerOutput([ScheduledSeq("p", [5], pos, [0, 1, 2, 3], True, prompt_len=16)])
        t0 = time.perf_counter()
        runner.execute(out)
        best = min(best, time.perf_counter() - t0)
    return best


def layer_overhead(dtype: torch.dtype = torch.bfloat16) -> float:
    """Seconds of fixed dispatch cost per decoder layer per step."""
    return max(0.0, (_decode_step_time(9, dtype) - _decode_step_time(1, dtype)) / 8)


def expert_overhead(experts: int = 32) -> float:
    """Seconds of fixed cost per routed expert a step runs (its two matmuls, activation,
    gather and scatter at toy widths)."""
    cfg = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=experts, top_k=1)
    layer = RoutedExperts(cfg)
    with torch.no_grad():
        layer.w13.normal_(0, 0.02)
        layer.w2.normal_(0, 0.02)
    x = torch.randn(experts, 64)
    ids = torch.arange(experts).unsqueeze(1)  # token i → expert i: every expert runs once
    weights = torch.ones(experts, 1)
    one_ids, one_w = ids[:1], weights[:1]
    best_all = best_one = float("inf")
    with torch.inference_mode():
        for _ in range(20):
            t0 = time.perf_counter()
            layer(x, weights, ids)
            t1 = time.perf_counter()
            layer(x[:1], one_w, one_ids)
            t2 = time.perf_counter()
            best_all, best_one = min(best_all, t1 - t0), min(best_one, t2 - t1)
    return max(0.0, (best_all - best_one) / (experts - 1))
