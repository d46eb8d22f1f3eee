"""`dsinfer compile --report`: measured operator counts, weight bytes, KV capacity, compile time.

Operator counts come from torch.profiler over one decode step (one new token after a short
context) of the first decoder layer: the operators (aten:: and our dsinfer:: kernels) that
layer dispatches directly, in the checkpoint's layout (q, k, v and gate, up as separate matmuls,
float weights) on the reference backend, then as compiled (fused projections, the artifact's
weight format) on the reference and on the fused backend.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from dsinfer.artifact.compiler import CompileOptions, compile_artifact
from dsinfer.artifact.reader import load_artifact
from dsinfer.artifact.verify import TrustPolicy
from dsinfer.config import QUANTISED_SCHEMES, CacheConfig, ModelConfig, parse_memory
from dsinfer.layers.linear import Linear, LinearMethod
from dsinfer.layers.quant import (
    experts_format,
    layer_format,
    quantizable_linears,
    routed_experts,
)
from dsinfer.models.loader import LoadedModel, load_model
from dsinfer.worker.input_batch import build_model_input
from dsinfer.worker.model_runner import ModelRunner
from dsinfer.worker.step_io import ScheduledSeq

_LAYER_RANGE = "dsinfer::decoder_layer_0"
_CONTEXT = 15  # tokens already in the cache before the measured decode step


class _PerShardLinearMethod(LinearMethod):
    """The checkpoint's layout: one matmul per original projection, outputs concatenated."""

    def __init__(self, shards: dict[str, tuple[int, int]]) -> None:
        self.shards = shards

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        outs = [
            F.linear(
                x,
                layer.weight.narrow(0, off, rows),
                None if bias is None else bias.narrow(0, off, rows),
            )
            for off, rows in self.shards.values()
        ]
        return torch.cat(outs, dim=-1)


def unfuse(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear) and len(module.shards) > 1:
            module.method = _PerShardLinearMethod(dict(module.shards))


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The profiler's C++ side prints start/stop lines on fd 2; keep the report clean."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass(frozen=True, slots=True)
class DecodeOps:
    """One decode step under torch.profiler."""

    per_layer: int  # operators the first decoder layer ran (aten:: and dsinfer:: kernels)
    from_python: int  # operators called from Python for the whole model (top-level events)


_PROGRAM_LAYER = "dsinfer::step_program_layer"  # the range the step program opens per layer


@torch.inference_mode()
def decode_ops(loaded: LoadedModel, backend: str = "reference", program: bool = False) -> DecodeOps:
    """Operators of one decode step: in the first decoder layer (a range around it, or the
    captured program's own per-layer range), and how many the model's forward called from
    Python (events without a parent)."""
    runner = ModelRunner(
        loaded,
        CacheConfig(block_size=16, num_blocks=2),
        torch.device("cpu"),
        backend=backend,
        step_program=program,
    )
    if program and not runner.step_program:
        raise ValueError("the decode step of this model cannot be captured as a program")
    seq = ScheduledSeq("probe", [1], _CONTEXT, [0, 1], do_sample=False)
    inp = build_model_input([seq], runner.block_size, runner.device)
    layer = loaded.model.model.layers[0]
    scope: list[record_function] = []

    def enter(*_: Any) -> None:
        scope.append(record_function(_LAYER_RANGE))
        scope[-1].__enter__()

    def leave(*_: Any) -> None:
        scope.pop().__exit__(None, None, None)

    hooks = [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        loaded.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)  # warm-up
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
            loaded.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
    finally:
        for h in hooks:
            h.remove()
        loaded.model.step_program = None  # the next measurement starts eager
    events = prof.events()
    name = _PROGRAM_LAYER if program else _LAYER_RANGE
    ranges = [e for e in events if e.name == name]
    assert ranges, f"no {name} range under the profiler"
    kernels = ("aten::", "dsinfer::")
    per_layer = sum(1 for c in ranges[0].cpu_children if c.name.startswith(kernels))
    top = sum(1 for e in events if e.cpu_parent is None and e.name.startswith(kernels))
    return DecodeOps(per_layer, top)


def decode_layer_ops(loaded: LoadedModel, backend: str = "reference") -> int:
    """Operators the first decoder layer dispatches in one decode step (torch.profiler)."""
    return decode_ops(loaded, backend).per_layer


def weight_bytes(model: nn.Module, group_size: int) -> dict[str, int]:
    """Bytes of the weights per scheme, from the shapes (bf16 for whatever stays float).

    A quantised head that was tied keeps its own copy: the embedding stays float."""
    totals = {"float32": 0, "bfloat16": 0, "int8": 0, "int4": 0}
    params = {id(p): p for p in model.parameters()}  # tied tensors once
    for p in params.values():
        totals["float32"] += 4 * p.numel()
        totals["bfloat16"] += 2 * p.numel()
    linears = [layer for _n, layer in quantizable_linears(model)]
    quantised_ids = {id(layer.weight) for layer in linears if not getattr(layer, "tied", False)}
    floats = sum(2 * p.numel() for i, p in params.items() if i not in quantised_ids)
    totals["int8"] = totals["int4"] = floats
    size = {
        "int8": lambda o, i: o * i + 2 * o,  # int8 weight, one bf16 scale per row
        "int4": lambda o, i: o * i // 2 + 4 * (i // group_size) * o,  # bf16 scale + zero
        "float": lambda o, i: 2 * o * i,
    }
    for layer in linears:
        for scheme in QUANTISED_SCHEMES:
            fmt, _why = layer_format(scheme, layer, group_size)
            totals[scheme] += size[fmt](layer.out_features, layer.in_features)
    for _name, experts in routed_experts(model):  # stacked [E, out, in]
        for scheme in QUANTISED_SCHEMES:
            fmt, _why = experts_format(scheme, experts, group_size)
            for w in (experts.w13, experts.w2):
                e, out_f, in_f = w.shape
                totals[scheme] += e * size[fmt](out_f, in_f) - 2 * w.numel()
    return totals


def kv_capacity(cfg: ModelConfig, dtype: torch.dtype, budget: int, block_size: int = 16) -> int:
    per_token = cfg.kv_bytes_per_token(dtype)
    return budget // (per_token * block_size) * block_size


def compile_with_report(
    src: str, out: Path, opts: CompileOptions, kv_budget: str | int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    manifest = compile_artifact(src, out, opts)
    seconds = time.perf_counter() - t0
    compiled = load_artifact(out, TrustPolicy(allow_unsigned=True))
    reference = load_model(src, compiled.dtype)
    unfuse(reference.model)
    budget = parse_memory(kv_budget)
    checkpoint, eager = decode_ops(reference), decode_ops(compiled)
    fused = decode_ops(compiled, "fused")
    try:
        program: DecodeOps | None = decode_ops(compiled, "fused", program=True)
    except ValueError:  # this model's step is not capturable here: eager figures only
        program = None
    return {
        "artifact": str(out),
        "version": manifest.short_version,
        "quant": opts.quant,
        "compile_seconds": seconds,
        "decode_ops_per_layer": {
            "checkpoint_layout": checkpoint.per_layer,
            "compiled": eager.per_layer,
            "compiled_fused": fused.per_layer,
            **({"compiled_program": program.per_layer} if program else {}),
        },
        # Operators the forward calls from Python per decode step (the whole model).
        "decode_calls_from_python": {
            "compiled": eager.from_python,
            "compiled_fused": fused.from_python,
            **({"compiled_program": program.from_python} if program else {}),
        },
        "weight_bytes": weight_bytes(reference.model, opts.group_size),
        "kv_bytes_per_token": compiled.config.kv_bytes_per_token(compiled.dtype),
        "kv_budget_bytes": budget,
        "kv_capacity_tokens": kv_capacity(compiled.config, compiled.dtype, budget),
    }
