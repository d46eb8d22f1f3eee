"""Linear layers with a quantisation seam and shard-aware weight loading.

A `LinearMethod` owns how weights are stored and multiplied (plain, or later int8/int4); the
layer only knows its shape. Fused layers (qkv, gate|up) accept checkpoint shards by name, so
models carry no loading code: the loader calls `param.weight_loader(param, tensor, shard)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod:
    """Seam for weight formats: how to create parameters and how to apply them."""

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


def default_weight_loader(
    param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None
) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(loaded.shape)}, "
            f"model expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x Wᵀ + b over one weight, or over several row shards fused into one matmul."""

    # Layers whose error reaches the output undamped (the LM head) get more bits.
    quant_sensitive = False

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[int],
        bias: bool = False,
        shard_names: Sequence[str] | None = None,
        method: LinearMethod | None = None,
        quantizable: bool = True,
    ) -> None:
        super().__init__()
        # False when another module reads `weight` directly (MLA's kv_b_proj), so the
        # weight must stay a plain float matrix.
        self.quantizable = quantizable
        sizes = [out_features] if isinstance(out_features, int) else list(out_features)
        self.in_features = in_features
        self.out_features = sum(sizes)
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, self.out_features, in_features)
        self.bias = (
            nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        )
        # shard name → (row offset, rows): where each checkpoint tensor lands in the fused weight.
        self.shards: dict[str, tuple[int, int]] = {}
        if shard_names is not None:
            assert len(shard_names) == len(sizes)
            off = 0
            for name, size in zip(shard_names, sizes, strict=True):
                self.shards[name] = (off, size)
                off += size
        for p in self.parameters(recurse=False):
            p.weight_loader = self._load  # type: ignore[attr-defined]
            p.shards = list(self.shards)  # type: ignore[attr-defined]  # what the loader expects

    def set_method(self, method: LinearMethod) -> None:
        """Swap the weight format (artifact load, compile): drops the old weight tensors."""
        for name in ("weight", "qweight", "scales", "scales_zeros"):
            self._parameters.pop(name, None)
        self.method = method
        method.create_weights(self, self.out_features, self.in_features)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        if shard is None:
            default_weight_loader(param, loaded)
            return
        off, rows = self.shards[shard]
        dst = param.data.narrow(0, off, rows)
        if tuple(dst.shape) != tuple(loaded.shape):
            raise ValueError(
                f"shape mismatch for shard {shard!r}: checkpoint has "
                f"{tuple(loaded.shape)}, model expects {tuple(dst.shape)}"
            )
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)
