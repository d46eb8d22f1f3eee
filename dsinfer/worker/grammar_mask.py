"""Constrained decoding on the worker: one grammar matcher per constrained request, token
bitmasks filled on a helper thread while the forward pass runs, applied to the logits before
sampling (and before logprobs, so reported logprobs are those of the constrained distribution).

Masking (apply_bitmask) runs the C++ op of layers/kernels/cpu_ops.cpp on CPU when it is built
(0.2 ms for 16 rows of 49k tokens, against ~3 ms for the torch unpacking), torch otherwise.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from dsinfer.structured.spec import UnsatisfiableConstraint


class GrammarState:
    """A request's position in its grammar; advanced by every token the request emits."""

    def __init__(self, matcher: Any, keep: torch.Tensor | None = None) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        self.dead_end = False  # the last fill allowed no token: no text satisfies it from here
        # [W] int32 word mask ANDed into every bitmask row (tokens the grammar admits that
        # the format does not: control bytes in JSON), or None.
        self.keep = keep

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            if self.dead_end:  # the constraint's fault: the request's 400
                raise UnsatisfiableConstraint(
                    f"the constraint admits no token after {self.num_accepted} token(s) of "
                    "output: no text satisfies it from there (a required part whose schema "
                    "refers only to itself, for example); fix the schema or grammar"
                )
            # The mask allowed only grammar tokens, so this is a bug, not bad input: the
            # request fails alone (engine/fault_isolation.py) rather than emit invalid output.
            raise RuntimeError(f"token {token} is not allowed by the request's grammar")
        self.num_accepted += 1

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an all-ones [B, W] bitmask ← the tokens allowed next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.keep is not None:
            bitmask[row] &= self.keep
        self.dead_end = not bool(bitmask[row].any()) and not self.matcher.is_terminated()

    @property
    def finished(self) -> bool:
        """The grammar accepted its stop token: the request ends here."""
        return bool(self.matcher.is_terminated())

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """One logits row [V] → a fp32 copy [1, V] with the tokens the grammar forbids next at
        -inf (speculative verification reads each check row after the tokens before it)."""
        bitmask = all_allowed(1, logits.shape[-1])
        self.fill(bitmask, 0)
        row = logits.unsqueeze(0).float().clone()  # [1, V]: masked in place
        apply_bitmask(row, bitmask)
        return row

    def rollback_to(self, num_accepted: int) -> None:
        """Undo tokens accepted in a step that failed (the step may be retried)."""
        if self.num_accepted > num_accepted:
            self.matcher.rollback(self.num_accepted - num_accepted)
            self.num_accepted = num_accepted


class BitmaskFiller:
    """Fills the [B, ceil(V/32)] int32 allowed-token bitmask of a step off the model thread."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None

    def start(self, grammars: list[GrammarState | None]) -> Future | None:
        """Begin filling rows for the constrained requests among `grammars` (one per sampled
        row, None = unconstrained); None when no row is constrained."""
        if all(g is None for g in grammars):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsinfer-grammar")
        return self._pool.submit(self._fill, grammars)

    def _fill(self, grammars: list[GrammarState | None]) -> torch.Tensor:
        bitmask = all_allowed(len(grammars), self.vocab_size)
        for row, g in enumerate(grammars):
            if g is not None:
                g.fill(bitmask, row)
        return bitmask


def all_allowed(rows: int, vocab_size: int) -> torch.Tensor:
    """A [rows, ceil(V/32)] int32 bitmask with every token allowed (bit t%32 of word t//32)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def keep_mask(banned: list[int], vocab_size: int) -> torch.Tensor:
    """[W] int32 words with every bit set except those of `banned` token ids."""
    bits = torch.ones((vocab_size + 31) // 32 * 32, dtype=torch.int64)
    bits[torch.tensor(banned, dtype=torch.int64)] = 0
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32, dtype=torch.int64)
    words = (bits.view(-1, 32) * weights).sum(-1)  # [W] as unsigned 32-bit values
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] fp32 (in place): -inf for every token the bitmask [B, W] does not allow."""
    bitmask = bitmask.to(logits.device)
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and _cpu_op_ready():
        torch.ops.dsinfer.apply_token_bitmask_(logits, bitmask.contiguous())
        return
    logits.masked_fill_(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))


def _cpu_op_ready() -> bool:
    from dsinfer.layers.kernels.cpu_build import load_cpu_ops

    return load_cpu_ops() is None  # cached after the first call; None = loaded


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 bitmask (bit j of word w = token 32w + j) → [B, vocab_size] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
