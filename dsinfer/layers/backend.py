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

import dataclasses
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


def kernels_of(name: str, int8_activations: bool = False) -> Kernels:
    kernels = FUSED_CPU if name == "fused" else REFERENCE
    return dataclasses.replace(kernels, int8_activations=True) if int8_activations else kernels


def int8_activations_unavailable(backend: str, device: torch.device) -> str | None:
    """Why int4 layers cannot take int8 activations with this backend on `device`, or None."""
    if backend != "fused" or device.type != "cpu":
        return "int8 activations are a kernel of the fused CPU backend"
    if not torch.ops.dsinfer.int4_i8_supported():
        return "this CPU has no AVX2 + FMA (the int8-activation kernel's instructions)"
    return None


def apply_backend(
    model: nn.Module, requested: str, device: torch.device, int8_activations: bool = False
) -> BackendChoice:
    """Switch every backend-dependent module of `model` to the chosen backend (with int8
    activations for its int4 layers where asked: a ValueError where they cannot run)."""
    choice = resolve_backend(requested, device)
    if int8_activations:
        why_not = int8_activations_unavailable(choice.name, device)
        if why_not:
            raise ValueError(
                f"--int8-activations cannot run here ({why_not}; backend {choice.name}, device "
                f"{device.type}): drop the flag"
            )
    kernels = kernels_of(choice.name, int8_activations)
    for module in model.modules():
        use = getattr(module, "use_kernels", None)
        if use is not None:
            use(kernels, device.type)
    if int8_activations:
        took = sum(getattr(getattr(m, "method", None), "int8_activations", False)
                   for m in model.modules())  # fmt: skip
        if took:
            logger.info("int8 activations: %d int4 layer(s) (llama.cpp's arithmetic)", took)
        else:
            logger.warning("--int8-activations: no int4 layer here, nothing changes (the flag "
                           "applies to int4 weights)")  # fmt: skip
    if requested == "auto" and choice.name == "reference" and device.type == "cpu":
        logger.warning("backend: reference, the slow path (%s)", choice.reason)
    else:
        logger.info("backend: %s (%s)", choice.name, choice.reason)
    return choice
