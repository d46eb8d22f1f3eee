"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.layers.linear import Linear, default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(Linear):
    """Logits in fp32 for the rows that need them only (the 576→49k matmul dominates a step).

    A Linear, so an artifact may store it quantised like any projection; when tied, it starts
    out sharing the embedding's weight (a quantised head keeps its own copy)."""

    quant_sensitive = True

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None) -> None:
        super().__init__(hidden_size, vocab_size)
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, hidden, None).float()
