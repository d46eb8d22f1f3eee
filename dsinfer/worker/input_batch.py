"""SchedulerOutput → flat input tensors and attention metadata for one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.layers.attention import AttentionMetadata, PrefillSeq
from dsinfer.worker.step_io import ScheduledSeq


@dataclass(frozen=True, slots=True)
class ModelInput:
    seqs: list[ScheduledSeq]  # in flat-batch order: decodes first, then prefills
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    last_rows: list[int]  # row of each seq's last token in the flat batch


# A decode with drafts to verify: below this context its rows go in as decode rows, one per
# position. The captured decode program takes them (SmolLM2, five rows: ~2 plain decode steps,
# against ~2.6 through the prefill path), and its kernels are batch-invariant row by row, so
# the verified tokens are plain decoding's bit for bit. Past it, each row rereading the whole
# cache would cost more than one chunk reading it once.
DRAFT_ROWS_MAX_CONTEXT = 1024


def _decode_rows(s: ScheduledSeq) -> bool:
    """Whether the sequence's rows are decode rows: a single token, or a decode and its drafts
    over a short enough context."""
    n = len(s.token_ids)
    return n == 1 or (
        s.num_draft > 0 and n == 1 + s.num_draft and s.start_pos + n <= DRAFT_ROWS_MAX_CONTEXT
    )


def build_model_input(
    seqs: list[ScheduledSeq], block_size: int, device: torch.device
) -> ModelInput:
    """Decode rows first (each with its own length: a drafted decode's rows see 1, 2, … more
    tokens, written in this step), then prefill chunks."""
    ordered = [s for s in seqs if _decode_rows(s)] + [s for s in seqs if not _decode_rows(s)]
    ids: list[int] = []
    pos: list[int] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    last_rows: list[int] = []
    prefills: list[PrefillSeq] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    for s in ordered:
        n = len(s.token_ids)
        end = s.start_pos + n
        q_start = len(ids)
        ids.extend(s.token_ids)
        pos.extend(range(s.start_pos, end))
        slot_blocks.extend(s.block_table[p // block_size] for p in range(s.start_pos, end))
        slot_offsets.extend(p % block_size for p in range(s.start_pos, end))
        last_rows.append(len(ids) - 1)
        table = s.block_table[: -(-end // block_size)]
        if _decode_rows(s):
            decode_tables.extend([table] * n)
            decode_lens.extend(range(s.start_pos + 1, end + 1))
        else:
            bt = torch.tensor(table, dtype=torch.int64, device=device)
            prefills.append(PrefillSeq(q_start, n, end, bt))
    decode_bt = decode_mask = lens = None
    if decode_tables:
        nb = max(len(t) for t in decode_tables)
        padded = [t + [0] * (nb - len(t)) for t in decode_tables]
        decode_bt = torch.tensor(padded, dtype=torch.int64, device=device)  # [B, NBmax]
        lens = torch.tensor(decode_lens, dtype=torch.int64, device=device)
        mask = torch.arange(nb * block_size, device=device).unsqueeze(0) >= lens.unsqueeze(1)
        decode_mask = mask.view(len(decode_tables), 1, 1, nb * block_size)  # over [B, KV, G, L]
    meta = AttentionMetadata(
        slot_blocks=torch.tensor(slot_blocks, dtype=torch.int64, device=device),
        slot_offsets=torch.tensor(slot_offsets, dtype=torch.int64, device=device),
        num_decode=len(decode_tables),
        decode_block_tables=decode_bt,
        decode_mask=decode_mask,
        prefills=tuple(prefills),
        decode_seq_lens=lens,
    )
    return ModelInput(
        seqs=ordered,
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(pos, dtype=torch.int64, device=device),
        meta=meta,
        last_rows=last_rows,
    )
