"""Which backend runs the model's kernels: `--backend auto|reference|fused`.

`reference` is eager torch everywhere (the oracle of the parity tests). `fused` is the fast
path: on the CPU, C++ kernels for norms, the gated activation and paged decode attention
(layers/kernels, layers/attention/fused_cpu.py) and the decode step as one C++ program; on CUDA,
fused SDPA decode attention (layers/attention/sdpa_paged.py) and the decode step recorded as a
graph per batch bucket (worker/decode_graphs.py). `auto` takes `fused` when it can run on the
device and says why when it cannot. The choice is applied after loading, on every rank, by
walking the model's modules: those with a backend-dependent part implement `use_kernels`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from dsinfer.layers.kernels import FUSED_CPU, REFERENCE, Kernels
from dsinfer.layers.kernels.cpu_build import load_cpu_ops

logger = logging.getLogger(__name__)
BACKENDS = ("auto", "reference", "fused")


@dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str  # reference | fused
    reason: str  # why this one (logged)


def fused_unavailable(device: torch.device) -> str | None:
    """Why the fused backend cannot run on `device`, or None."""
    if device.type == "cuda":
        return None
    if device.type != "cpu":
        return f"no fused backend for {device.type} yet"
    return load_cpu_ops()


def resolve_backend(requested: str, device: torch.device) -> BackendChoice:
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    if requested == "reference":
        return BackendChoice("reference", "requested")
    why_not = fused_unavailable(device)
    if requested == "fused":
        if why_not:
            raise ValueError(
                f"the fused backend cannot run here: {why_not}; use backend 'reference' or 'auto'"
            )
        return BackendChoice("fused", "requested")
    if why_not:
        return BackendChoice("reference", f"auto: {why_not}")
    return BackendChoice("fused", f"auto: fused kernels for {device.type}")


def kernels_of(name: str) -> Kernels:
    return FUSED_CPU if name == "fused" else REFERENCE


def apply_backend(model: nn.Module, requested: str, device: torch.device) -> BackendChoice:
    """Switch every backend-dependent module of `model` to the chosen backend."""
    choice = resolve_backend(requested, device)
    kernels = kernels_of(choice.name)
    for module in model.modules():
        use = getattr(module, "use_kernels", None)
        if use is not None:
            use(kernels, device.type)
    if requested == "auto" and choice.name == "reference" and device.type == "cpu":
        logger.warning("backend: reference, the slow path (%s)", choice.reason)
    else:
        logger.info("backend: %s (%s)", choice.name, choice.reason)
    return choice
