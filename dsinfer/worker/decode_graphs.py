"""Decode steps as captured graphs, one per (batch bucket, context bucket): the accelerators'
compiled step (CUDA graphs; NPU graphs through torch_npu).

A graph replays fixed kernels on fixed buffers, so a step's shapes must be fixed too. A
decode-only step of B sequences whose block tables are NB blocks wide runs on the graph of the
smallest buckets that hold it (B → 1, 2, 4, 8, …; NB → 1, 2, 4, … up to the longest sequence's
blocks), captured the first time that pair is met. Its rows past B are padding: token 0 at
position 0, one token of context, and their K/V written into a block of the pool reserved for
them (`pad_block`, never handed to a sequence), so a padding row can neither overwrite nor
read a live sequence's cache. Table columns past a sequence's own blocks point at that block
too and are masked by the sequence's length.

What is captured is the model's forward pass (embeddings to the final norm) for the padded
batch; the logits of the rows that sample and the sampling stay outside, on the real rows.
On the CPU (no graphs) the same code runs with eager "graphs" (`device/graphs.EagerGraph`):
that is how the padding and bucket logic is tested on the machines here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsinfer.device.graphs import StepGraph, new_step_graph
from dsinfer.layers.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


def buckets_up_to(limit: int) -> tuple[int, ...]:
    """1, 2, 4, … while below `limit`, then `limit` itself: every size 1..limit has a bucket."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    out.append(limit)
    return tuple(out)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)


def graph_unsafe(model: torch.nn.Module) -> str | None:
    """Why the model's decode step cannot be recorded, or None: an attention whose decode has
    data-dependent shapes or host syncs, or a module that says so (`graph_safe = False`, the
    routed experts)."""
    for module in model.modules():
        if getattr(module, "graph_safe", True) is False:
            return f"{type(module).__name__} reads data on the host"
        for attn in vars(module).values():
            if isinstance(attn, AttentionBackend) and not attn.graph_safe_decode:
                return f"{type(attn).__name__} cannot run inside a captured graph"
    return None


@dataclass
class _Bucket:
    """One captured graph and the static buffers it reads."""

    graph: StepGraph
    ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_blocks: torch.Tensor  # [B] int64
    slot_offsets: torch.Tensor  # [B] int64
    tables: torch.Tensor  # [B, NB] int64
    lens: torch.Tensor  # [B] int64


class DecodeGraphs:
    """`takes(meta, rows)` says whether a step can replay a graph; `run` replays it."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        pad_block: int,
        block_size: int,
        max_batch: int,
        max_blocks: int,
        device: torch.device,
    ) -> None:
        """forward(input_ids [T], positions [T], meta) → hidden [T, H]: the model's pass over
        its KV pool. max_batch: the scheduler's most sequences a step; max_blocks: the most
        blocks a sequence can hold (max model length / block size)."""
        self._forward = forward
        self.pad_block = pad_block
        self.block_size = block_size
        self.batch_buckets = buckets_up_to(max_batch)
        self.context_buckets = buckets_up_to(max_blocks)
        self.device = device
        self.graphs: dict[tuple[int, int], _Bucket] = {}
        self.replays = 0

    def takes(self, rows: int, meta: AttentionMetadata) -> bool:
        """A decode-only step (one token a sequence) that fits the largest buckets."""
        return (
            meta.num_decode == rows
            and not meta.prefills
            and meta.decode_block_tables is not None
            and meta.decode_seq_lens is not None
            and rows <= self.batch_buckets[-1]
            and meta.decode_block_tables.shape[1] <= self.context_buckets[-1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The step's hidden states [B, H]: a view of the graph's output buffer, valid until
        the next replay (the runner takes its logits before the next step)."""
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        b, nb = meta.decode_block_tables.shape
        key = (bucket_for(b, self.batch_buckets), bucket_for(nb, self.context_buckets))
        bucket = self.graphs.get(key) or self._capture(*key)
        self._load(bucket, input_ids, positions, meta)
        self.replays += 1
        return bucket.graph.replay()[:b]

    def _load(
        self, s: _Bucket, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """The step into the bucket's buffers; rows and columns past it are padding."""
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        b, nb = meta.decode_block_tables.shape
        s.ids[:b].copy_(input_ids)
        s.positions[:b].copy_(positions)
        s.slot_blocks[:b].copy_(meta.slot_blocks)
        s.slot_offsets[:b].copy_(meta.slot_offsets)
        s.lens[:b].copy_(meta.decode_seq_lens)
        s.tables.fill_(self.pad_block)
        s.tables[:b, :nb].copy_(meta.decode_block_tables)
        if b < s.ids.shape[0]:
            _pad_rows(s, b, self.pad_block)

    def _capture(self, batch: int, blocks: int) -> _Bucket:
        def zeros() -> torch.Tensor:
            return torch.zeros(batch, dtype=torch.int64, device=self.device)

        s = _Bucket(
            new_step_graph(self.device),
            zeros(),
            zeros(),
            zeros(),
            zeros(),
            torch.full((batch, blocks), self.pad_block, dtype=torch.int64, device=self.device),
            zeros(),
        )
        _pad_rows(s, 0, self.pad_block)  # captured (and warmed up) on padding rows only
        span = torch.arange(blocks * self.block_size, device=self.device)
        # The graph keeps `step` and what it closes over (device/graphs.py): the span, the
        # buffers, the model's forward; not `self`, which would make a reference cycle that
        # keeps the weights and KV pool alive after the runner goes, until a gc pass.
        forward = self._forward

        def step() -> torch.Tensor:
            # The mask comes from the lengths inside the graph: one buffer fewer to fill.
            mask = (span.unsqueeze(0) >= s.lens.unsqueeze(1)).view(batch, 1, 1, -1)
            meta = AttentionMetadata(
                slot_blocks=s.slot_blocks,
                slot_offsets=s.slot_offsets,
                num_decode=batch,
                decode_block_tables=s.tables,
                decode_mask=mask,
                prefills=(),
                decode_seq_lens=s.lens,
            )
            return forward(s.ids, s.positions, meta)

        s.graph.capture(step)
        self.graphs[(batch, blocks)] = s
        logger.info(
            "decode graph captured: %d rows × %d blocks (%d graphs)",
            batch,
            blocks,
            len(self.graphs),
        )
        return s


def _pad_rows(s: _Bucket, start: int, pad_block: int) -> None:
    """Rows from `start` on: token 0 at position 0, its K/V into the pad block, one token of
    context (a row attending to nothing would divide by zero). Their table rows hold the pad
    block already (filled at capture, and by _load before each step)."""
    s.ids[start:] = 0
    s.positions[start:] = 0
    s.slot_blocks[start:] = pad_block
    s.slot_offsets[start:] = 0
    s.lens[start:] = 1
