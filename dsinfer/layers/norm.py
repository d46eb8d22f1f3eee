"""RMSNorm with the residual add fused in (one call per sub-layer boundary)."""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.layers.kernels import REFERENCE, Kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))
        self.kernels = REFERENCE

    def use_kernels(self, kernels: Kernels, device_type: str) -> None:
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); with no residual, x itself is the residual."""
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps), x
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
