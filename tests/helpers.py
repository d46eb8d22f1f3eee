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


def decode_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position of `ids`, fed one token per step: every row runs the
    decode path (single-token rows), as generation does."""
    bs = engine.block_size
    blocks = engine.pool.allocate(-(-len(ids) // bs))
    runner = engine.executor.runner
    rows = []
    try:
        for pos, tok in enumerate(ids):
            seq = ScheduledSeq("probe", [tok], pos, blocks, do_sample=False)
            inp = build_model_input([seq], bs, runner.device)
            hidden = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
            rows.append(runner.model.compute_logits(hidden))
        return torch.cat(rows)
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


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:  # noqa: ANN001
    """The reference's n greedy tokens (EOS ignored) and its logits at each of those steps."""
    gen = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return gen.sequences[0, len(ids) :].tolist(), torch.stack([lg[0] for lg in gen.logits])


def tiny_llama_dir(  # noqa: ANN201
    path,  # noqa: ANN001
    num_layers: int = 2,
    tied: bool = False,
    vocab_size: int = 320,
    max_positions: int = 64,
):
    """A tiny random Llama checkpoint with a word-level tokenizer, saved by transformers. A
    larger `vocab_size` fits a real tokenizer given to the engine instead (SmolLM2's: 49152)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.test_tiny_parity import _tokenizer_files

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    _tokenizer_files(path)
    return path


def save_and_load(model, path, backend: str = "auto", **kwargs):  # noqa: ANN001, ANN201
    """Save a transformers model with the tiny tokenizer; load it with dsinfer (fp32)."""
    from dsinfer import LLM
    from tests.models.test_tiny_parity import _tokenizer_files

    model.eval()
    if not (path / "config.json").exists():
        model.save_pretrained(path)
        _tokenizer_files(path)
    options = {"dtype": "float32", "num_blocks": 64, "block_size": 4, **kwargs}
    return LLM(str(path), backend=backend, **options)


def assert_logits_match(llm, ref, lengths: tuple[int, ...], vocab: int, tol: float) -> None:  # noqa: ANN001
    """Random prompts of each length: our logits at every position within tol of ref's."""
    g = torch.Generator().manual_seed(0)
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        with torch.inference_mode():
            want = ref(torch.tensor([ids])).logits[0]
        err = (full_logits(llm.engine, ids) - want).abs().max().item()
        assert err < tol, (n, err)


def assert_batched_greedy_matches(llm, ref, lengths: tuple[int, ...], vocab: int, n: int) -> None:  # noqa: ANN001
    """Random prompts of the given lengths run as one batch: n greedy tokens each equal the
    reference's (up to a genuine near-tie); the pool is clean afterwards."""
    from dsinfer import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
    )
    for p, out in zip(prompts, outs, strict=True):
        want, logits = hf_greedy(ref, p, n)
        assert tokens_match_up_to_near_tie(out.outputs[0].token_ids, want, logits), p
    assert_pool_clean(llm.engine)
