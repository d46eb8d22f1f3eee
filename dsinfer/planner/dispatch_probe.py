"""Fixed per-step costs that do not scale with the weights' bytes: per decoder layer, and per
routed expert a step runs. Measured on dsinfer's own layers at two realistic widths each and
fitted as time = fixed + bytes / rate; the fixed part (the intercept) is what a smaller shard
does not save — operator dispatch, the paged-attention bookkeeping, and the lower streaming
rate of narrow matrices. This is why slicing an expert over TP ranks costs more than placing
whole experts (measured: a 2048×704 expert streams at 7 GB/s, a 2048×1408 one at 9). On GPUs
graphs and asynchronous launches hide most of it (the datasheet profiles leave it at zero).
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


def _intercept(small: tuple[float, float], large: tuple[float, float]) -> float:
    """(bytes, seconds) at two sizes → seconds at zero bytes on their line (≥ 0)."""
    (b1, t1), (b2, t2) = small, large
    return max(0.0, t1 - b1 * (t2 - t1) / (b2 - b1))


def _llama(hidden: int, layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 256,
        "max_position_embeddings": 256,
        "num_hidden_layers": layers,
    }


def _decode_step(hidden: int, layers: int, dtype: torch.dtype, steps: int = 20) -> float:
    """Seconds per batch-1 decode step of a random Llama (best of `steps`)."""
    from dsinfer.sampling import SamplingParams

    cfg = config_from_hf(_llama(hidden, layers))
    net = build_model(cfg, dtype, "cpu")
    fill_random_weights(net, 0)
    loaded = LoadedModel(net, cfg, None, dtype)  # type: ignore[arg-type]
    runner = ModelRunner(loaded, CacheConfig(block_size=16, num_blocks=8), torch.device("cpu"))
    params = SamplingParams(temperature=0, max_tokens=steps + 2)
    prompt = list(range(1, 17))
    table = [0, 1, 2, 3]
    runner.execute(
        SchedulerOutput(
            [ScheduledSeq("p", prompt, 0, table, True, prompt_len=16)],
            [NewRequestData("p", prompt, params)],
        )
    )
    best = float("inf")
    for pos in range(16, 16 + steps):
        out = SchedulerOutput([ScheduledSeq("p", [5], pos, table, True, prompt_len=16)])
        t0 = time.perf_counter()
        runner.execute(out)
        best = min(best, time.perf_counter() - t0)
    return best


def _layer_point(hidden: int, dtype: torch.dtype) -> tuple[float, float]:
    """(weight bytes of one decoder layer, seconds it adds to a decode step)."""
    per_layer = (_decode_step(hidden, 9, dtype) - _decode_step(hidden, 1, dtype)) / 8
    heads, kv, d = hidden // 64, hidden // 256, 64
    params = hidden * (heads + 2 * kv) * d + heads * d * hidden + 3 * hidden * 3 * hidden
    return params * dtype.itemsize, per_layer


def layer_overhead(dtype: torch.dtype = torch.bfloat16) -> float:
    """Seconds per decoder layer per decode step that its bytes do not account for."""
    return _intercept(_layer_point(512, dtype), _layer_point(1024, dtype))


def _expert_point(hidden: int, inter: int, dtype: torch.dtype, experts: int = 16) -> tuple:
    """(weight bytes of one expert, seconds per expert run with two tokens each)."""
    cfg = MoEConfig(hidden_size=hidden, intermediate_size=inter, num_experts=experts, top_k=1)
    layer = RoutedExperts(cfg).to(dtype)
    with torch.no_grad():
        layer.w13.normal_(0, 0.02)
        layer.w2.normal_(0, 0.02)
    x = torch.randn(2 * experts, hidden, dtype=dtype)
    ids = torch.arange(experts).repeat_interleave(2).unsqueeze(1)  # every expert, 2 tokens
    weights = torch.ones(2 * experts, 1)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(4):
            t0 = time.perf_counter()
            layer(x, weights, ids)
            best = min(best, time.perf_counter() - t0)
    return 3 * hidden * inter * dtype.itemsize, best / experts


def expert_overhead(dtype: torch.dtype = torch.bfloat16) -> float:
    """Seconds per routed expert run that its bytes do not account for (DeepSeek-V2-Lite's
    expert width, whole and halved)."""
    return _intercept(_expert_point(2048, 704, dtype), _expert_point(2048, 1408, dtype))
