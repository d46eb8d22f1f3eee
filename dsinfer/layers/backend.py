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

from dsinfer.config import INT8_ACTIVATIONS
from dsinfer.layers.kernels import FUSED_ACCELERATOR, FUSED_CPU, REFERENCE, Kernels
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


def kernels_of(name: str, int8_activations: str = "none", device_type: str = "cpu") -> Kernels:
    if name != "fused":
        kernels = REFERENCE
    else:
        kernels = FUSED_CPU if device_type == "cpu" else FUSED_ACCELERATOR
    if int8_activations == "none":
        return kernels
    return dataclasses.replace(kernels, int8_activations=int8_activations)


def _int8_activations_unavailable(backend: str, device: torch.device) -> str | None:
    """Why the int8-activation kernel cannot run with this backend and device, or None."""
    if backend != "fused" or device.type != "cpu":
        return "int8 activations are a kernel of the fused CPU backend"
    if not torch.ops.dsinfer.int4_i8_supported():
        return "this CPU has no AVX2 + FMA (the int8-activation kernel's instructions)"
    return None


def resolve_int8_activations(requested: str, backend: str, device: torch.device) -> str:
    """--int8-activations → the policy the kernels apply: none, out_proj or all.

    auto takes all wherever the kernel runs (AVX2 + FMA), within the quality gate (+0.3%
    perplexity or less; docs/backends.md): on AVX2 the exact int16 kernel is bound by
    `vpmaddwd`, and int8 gives 1.4-1.55x its rate with many rows; on AVX-512 VNNI `vpdpbusd`
    multiplies 64 byte pairs an instruction where the exact kernel's `vdpbf16ps` takes 32
    bf16 ones (SmolLM2, 16 streams: 2.3-2.5x; one stream 1.1x). none off the CPU. out_proj /
    all where the kernel cannot run: a ValueError with the reason."""
    if requested not in INT8_ACTIVATIONS:
        raise ValueError(
            f"unknown int8 activations {requested!r}; choose one of {', '.join(INT8_ACTIVATIONS)}"
        )
    if requested == "none":
        return requested
    why_not = _int8_activations_unavailable(backend, device)
    if requested == "auto":
        return "all" if why_not is None else "none"
    if why_not:
        raise ValueError(
            f"--int8-activations {requested} cannot run here ({why_not}; backend {backend}, "
            f"device {device.type}): use none"
        )
    return requested


def apply_backend(
    model: nn.Module, requested: str, device: torch.device, int8_activations: str = "none"
) -> BackendChoice:
    """Switch every backend-dependent module of `model` to the chosen backend, with int8
    activations for the int4 layers the policy names (a ValueError where it cannot run)."""
    choice = resolve_backend(requested, device)
    int8 = resolve_int8_activations(int8_activations, choice.name, device)
    kernels = kernels_of(choice.name, int8, device.type)
    for module in model.modules():
        use = getattr(module, "use_kernels", None)
        if use is not None:
            use(kernels, device.type)
    if requested == "auto" and choice.name == "reference" and device.type == "cpu":
        logger.warning("backend: reference, the slow path (%s)", choice.reason)
    else:
        logger.info("backend: %s (%s)", choice.name, choice.reason)
    if int8 != "none":
        _log_int8_activations(model, int8, int8_activations)
    return choice


def _log_int8_activations(model: nn.Module, policy: str, requested: str) -> None:
    methods = [m.method for m in model.modules() if hasattr(getattr(m, "method", None), "int8")]
    took = sum(bool(method.int8) for method in methods)
    how = f"{policy}, {requested}" if requested != policy else policy
    if took:
        logger.info(
            "int8 activations (%s): %d of %d quantised layers (--int8-activations none: exact)",
            how,
            took,
            len(methods),
        )
    elif methods:
        logger.info("int8 activations (%s): no quantised layer takes them here", how)
