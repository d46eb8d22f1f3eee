"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsinfer.layers.kernels import REFERENCE, Kernels

SUPPORTED = ("silu",)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] laid out as [gate | up] → silu(gate) * up: [T, I]."""
    return REFERENCE.silu_and_mul(x)


def get_gated_activation(
    name: str, kernels: Kernels = REFERENCE
) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in SUPPORTED:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(SUPPORTED)}")
    return kernels.silu_and_mul
