"""Token embedding and the LM head (which may share the embedding's weight).

Under tensor parallel both split the vocabulary: rank r holds rows [r·V/tp, (r+1)·V/tp) of the
table. The embedding looks up the ids that fall in its range (zeros elsewhere) and the TP group
sums; the head computes its slice of the logits and the group gathers them. A vocabulary that
does not divide by tp stays whole on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.distributed.comm import all_gather_last, all_reduce
from dsinfer.distributed.parallel_state import parallel_state
from dsinfer.layers.kernels import Kernels
from dsinfer.layers.linear import Linear

# ids [T] → rows [T, hidden] of the table, in the given dtype
RowReader = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def vocab_splits(vocab_size: int) -> bool:
    tp = parallel_state().tp_size
    return tp > 1 and vocab_size % tp == 0


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = parallel_state()
        self.split = vocab_splits(vocab_size)
        rows = vocab_size // tp.tp_size if self.split else vocab_size
        self.rows = rows  # this rank's part of the vocabulary
        self.start = tp.tp_rank * rows if self.split else 0
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        self._rows: RowReader | None = None  # read_rows_from: the table lives elsewhere

    def read_rows_from(self, rows: RowReader) -> None:
        """Look rows up through `rows` (a tied, quantised LM head's weight) and drop this
        table's own float copy: one copy of the vocabulary in memory, as llama.cpp keeps."""
        self._rows = rows
        self.weight = nn.Parameter(self.weight.data.new_empty(0, self.weight.shape[1]), False)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self._rows is None:
            return F.embedding(ids, self.weight)
        return self._rows(ids, self.weight.dtype)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: None = None) -> None:
        rows = param.shape[0]
        if loaded.shape[0] != rows * (parallel_state().tp_size if self.split else 1) or (
            loaded.shape[1:] != param.shape[1:]
        ):
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
                f"{tuple(param.shape)} per rank"
            )
        param.data.copy_(self.local_part("weight", loaded))

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the whole stored table."""
        return full.narrow(0, self.start, self.rows) if self.split else full

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = self._lookup(local.masked_fill(outside, 0))  # [T, H]
        return all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class LMHead(Linear):
    """Logits in fp32 for the rows that need them only (the 576→49k matmul dominates a step).

    A Linear, so an artifact may store it quantised like any projection; when tied, it starts
    out sharing the embedding's weight (a quantised head keeps its own copy)."""

    quant_sensitive = True

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None) -> None:
        split = vocab_splits(vocab_size)
        super().__init__(hidden_size, vocab_size, parallel="column" if split else None)
        self.tied = tied_to is not None
        # Not a submodule (a list hides it from nn.Module): the embedding belongs to the model.
        self._tied_to = [tied_to] if tied_to is not None else []
        if tied_to is not None:
            self.weight = tied_to.weight

    def use_kernels(self, kernels: Kernels, device_type: str) -> None:
        super().use_kernels(kernels, device_type)
        # A quantised head whose method reads rows keeps the only copy of a tied vocabulary:
        # the embedding looks its rows up there (the fused backend; -54 MiB for SmolLM2).
        rows = getattr(self.method, "rows", None)
        if self._tied_to and rows is not None and getattr(self.method, "reads_rows", False):
            self._tied_to[0].read_rows_from(lambda ids, dtype: rows(self, ids, dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] → [N, vocab] fp32 (a collective under a split vocabulary: every TP rank
        of stage 0 calls it for the same rows)."""
        logits = self.method.apply_fp32(self, hidden, None)
        return all_gather_last(logits) if self.parallel == "column" else logits
