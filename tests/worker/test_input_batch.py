"""build_model_input in isolation: decodes first, slots from block tables, attention metadata."""

from __future__ import annotations

import torch

from dsinfer.worker.input_batch import build_model_input
from dsinfer.worker.step_io import ScheduledSeq


def test_flat_batch_orders_decodes_first_and_maps_slots():
    block = 4
    prefill = ScheduledSeq("p", [11, 12, 13, 14, 15], 3, [7, 8, 9], True)  # positions 3..7
    decode = ScheduledSeq("d", [21], 9, [2, 5, 6], True)  # position 9
    inp = build_model_input([prefill, decode], block, torch.device("cpu"))
    assert [s.req_id for s in inp.seqs] == ["d", "p"]
    assert inp.input_ids.tolist() == [21, 11, 12, 13, 14, 15]
    assert inp.positions.tolist() == [9, 3, 4, 5, 6, 7]
    assert inp.last_rows == [0, 5]
    meta = inp.meta
    # position p lives in block_table[p // 4] at offset p % 4
    assert meta.slot_blocks.tolist() == [6, 7, 8, 8, 8, 8]
    assert meta.slot_offsets.tolist() == [1, 3, 0, 1, 2, 3]
    assert meta.num_decode == 1 and meta.decode_seq_lens.tolist() == [10]
    assert meta.decode_block_tables.tolist() == [[2, 5, 6]]
    (p,) = meta.prefills
    assert (p.q_start, p.q_len, p.ctx_len) == (1, 5, 8)
    assert p.block_table.tolist() == [7, 8]  # the blocks the 8 positions need


def test_decode_mask_hides_padding_of_shorter_tables():
    a = ScheduledSeq("a", [1], 0, [3], True)  # length 1: one block
    b = ScheduledSeq("b", [2], 5, [4, 5], True)  # length 6: two blocks
    meta = build_model_input([a, b], 4, torch.device("cpu")).meta
    assert meta.decode_block_tables.tolist() == [[3, 0], [4, 5]]
    visible = (~meta.decode_mask.view(2, -1)).sum(-1).tolist()
    assert visible == [1, 6]


def test_a_decode_with_drafts_is_decode_rows_until_its_context_is_long():
    """Each of its rows a decode row of its own length (the captured program takes the step);
    past DRAFT_ROWS_MAX_CONTEXT one prefill chunk, which reads the cache once for all rows."""
    from dsinfer.layers.step_program import StepProgram
    from dsinfer.worker.input_batch import DRAFT_ROWS_MAX_CONTEXT

    cpu = torch.device("cpu")
    drafted = ScheduledSeq("a", [7, 1, 2, 3], 10, [0, 1, 2, 3], True, num_draft=3)
    plain = ScheduledSeq("b", [9], 5, [4, 5], True)
    inp = build_model_input([plain, drafted], 4, cpu)
    assert inp.meta.num_decode == 5 and not inp.meta.prefills
    assert inp.meta.decode_seq_lens.tolist() == [6, 11, 12, 13, 14]
    assert inp.meta.decode_block_tables[1:].tolist() == [[0, 1, 2, 3]] * 4
    assert inp.last_rows == [0, 4]
    assert StepProgram.takes(5, inp.meta)
    far = DRAFT_ROWS_MAX_CONTEXT - 2
    late = ScheduledSeq("c", [7, 1, 2], far, list(range(far // 4 + 2)), True, num_draft=2)
    inp = build_model_input([late, plain], 4, cpu)
    assert inp.meta.num_decode == 1 and len(inp.meta.prefills) == 1
    assert [s.req_id for s in inp.seqs] == ["b", "c"]
