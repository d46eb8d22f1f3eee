"""Test helpers that reach below the public API on purpose (logits at every position)."""

from __future__ import annotations

import torch

from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.worker.input_batch import build_model_input
from dsinfer.worker.step_io import ScheduledSeq


@torch.inference_mode()
def full_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position of `ids`, computed through the paged cache path."""
    bs = engine.block_size
    blocks = engine.pool.allocate(-(-len(ids) // bs))
    try:
        seq = ScheduledSeq("probe", list(ids), 0, blocks, do_sample=False)
        runner = engine.executor.runner
        inp = build_model_input([seq], bs, runner.device)
        hidden = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
        return runner.model.compute_logits(hidden)
    finally:
        engine.pool.free(blocks)


def assert_pool_clean(engine: LLMEngine) -> None:
    """Integrity holds and no block is held once every request is done."""
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_used == 0, f"{engine.pool.num_used} KV blocks leaked"


def tokens_match_up_to_near_tie(
    ours: list[int], ref: list[int], ref_logits: torch.Tensor | None, tol: float = 1e-3
) -> bool:
    """Identical, or parting at a position where the reference's top-2 logits are within tol."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            if ref_logits is None:
                return False
            top2 = torch.topk(ref_logits[i], 2).values
            return float(top2[0] - top2[1]) <= tol
    return len(ours) == len(ref)


def agree_or_near_tie(engine: LLMEngine, prompt: list[int], a: list[int], b: list[int]) -> bool:
    """Two of our own runs agree, or part where the model's top-2 logits are within 1e-3."""
    if a == b:
        return True
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if i is None:
        return False  # one is a strict prefix of the other: lengths differ, not a tie
    logits = full_logits(engine, prompt + a[:i])[-1]
    top2 = torch.topk(logits, 2).values
    return float(top2[0] - top2[1]) <= 1e-3
