"""Constrained decoding below the server: the bitmask arithmetic, the schema check, grammar
rollback after a failed step, preemption and n > 1 through the offline LLM."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.structured import StructuredOutputs, check_json_schema, compiler_for
from dsinfer.worker.grammar_mask import allowed_tokens, keep_mask
from tests.helpers import assert_pool_clean, tiny_llama_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "n"],
}


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> LLM:
    src = tiny_llama_dir(
        tmp_path_factory.mktemp("tiny-grammar"), num_layers=1, vocab_size=49152, max_positions=256
    )
    return LLM(str(src), tokenizer="smollm2", num_blocks=128, block_size=8)


def test_keep_mask_and_unpacking_round_trip():
    vocab = 100
    banned = [0, 5, 31, 32, 63, 99]
    keep = keep_mask(banned, vocab)
    assert keep.dtype == torch.int32 and keep.shape == (4,)
    allowed = allowed_tokens(keep.unsqueeze(0), vocab)[0]
    assert allowed.shape == (vocab,)
    assert [i for i in range(vocab) if not allowed[i]] == banned


def test_schema_check_names_the_keyword_and_where():
    check_json_schema(SCHEMA)
    check_json_schema({"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a", "title": "t"})
    with pytest.raises(ValueError, match=r"'allOf' \(at #/properties/x/allOf\)"):
        check_json_schema({"properties": {"x": {"allOf": [{"type": "string"}]}}})
    with pytest.raises(ValueError, match="'uniqueItems'"):
        check_json_schema({"type": "array", "uniqueItems": True})
    with pytest.raises(ValueError, match="only local references"):
        check_json_schema({"$ref": "https://example.com/s.json"})
    with pytest.raises(ValueError, match="format 'phone'"):
        check_json_schema({"items": {"type": "string", "format": "phone"}})


def test_spec_takes_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", grammar="root ::= a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs.from_schema("{oops")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured=StructuredOutputs(regex="a"), ignore_eos=True)


def test_json_rows_never_admit_control_bytes(tiny_llm):
    tok = tiny_llm.tokenizer
    grammars = compiler_for(tok, tiny_llm.engine.model_config.vocab_size)
    banned = set(grammars.control_tokens())
    assert tok.token_to_id("Ċ") in banned  # "\n" as a byte-level token
    assert tok.token_to_id("<|im_end|>") not in banned  # stop tokens stay


def test_compiled_once_and_matcher_rolls_back(tiny_llm):
    grammars = compiler_for(tiny_llm.tokenizer, tiny_llm.engine.model_config.vocab_size)
    spec = StructuredOutputs.from_schema(SCHEMA)
    before = grammars.misses
    first, second = grammars.compile(spec), grammars.compile(spec)
    assert first is second and grammars.misses <= before + 1
    from dsinfer.worker.grammar_mask import GrammarState

    state = GrammarState(grammars.new_matcher(spec))
    ids = tiny_llm.tokenizer.encode('{"name": "ab', add_special_tokens=False)
    for t in ids:
        state.accept(t)
    state.rollback_to(1)  # as after a failed step: back to the first token
    for t in ids[1:]:
        state.accept(t)  # the same tokens are accepted again
    with pytest.raises(RuntimeError, match="not allowed"):
        state.accept(tiny_llm.tokenizer.token_to_id("<|im_end|>"))  # inside an open string


def _valid(out, schema) -> bool:  # noqa: ANN001
    c = out.outputs[0]
    if c.finish_reason == "length":
        return True
    jsonschema.validate(json.loads(c.text), schema)
    return True


def test_n_and_preemption_keep_outputs_valid(tmp_path):
    src = tiny_llama_dir(tmp_path, num_layers=1, vocab_size=49152, max_positions=256)
    # 8 requests × ~60 tokens in 12 blocks of 8: the pool runs out, requests are preempted and
    # recomputed; their grammar state must survive it.
    llm = LLM(
        str(src), tokenizer="smollm2", num_blocks=12, block_size=8, enable_prefix_caching=False
    )
    params = SamplingParams(
        n=1, max_tokens=48, temperature=1.0, structured=StructuredOutputs.from_schema(SCHEMA)
    )
    outs = llm.generate(["Give the record as JSON:"] * 8, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(_valid(o, SCHEMA) for o in outs)
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 4
    assert_pool_clean(llm.engine)
    fanned = llm.generate("Record:", SamplingParams(n=4, max_tokens=48, temperature=1.0, seed=7, structured=StructuredOutputs.from_schema(SCHEMA)))  # fmt: skip
    assert len(fanned[0].outputs) == 4
    for c in fanned[0].outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_drafts_are_verified_against_the_grammar(tmp_path):
    """verify_drafts on designed logits: without a grammar the row's argmax (a forbidden token)
    ends the run of drafts; with it, each row's best allowed token is taken and accepted, and a
    sampled request draws only allowed tokens."""
    from types import SimpleNamespace

    from dsinfer.structured import GrammarCompiler
    from dsinfer.tokenizer import load_tokenizer
    from dsinfer.worker.grammar_mask import GrammarState
    from dsinfer.worker.sampler import Sampler, SamplerState
    from dsinfer.worker.spec_decode import draft_rows, verify_drafts
    from dsinfer.worker.step_io import ModelRunnerOutput, ScheduledSeq
    from tests.helpers import write_tiny_tokenizer as _tokenizer_files

    _tokenizer_files(tmp_path)
    tok = load_tokenizer(tmp_path)
    vocab = tok.vocab_size
    # rows: [last token, draft 1, draft 2]; the drafts are checked at rows 1 and 2.
    seq = ScheduledSeq("r", [9, 3, 5], 10, [], True, num_draft=2)
    inp = SimpleNamespace(seqs=[seq], last_rows=[2])
    spec, rows = draft_rows(inp, {"r"})
    assert rows == [1, 2]  # the rows after each draft
    logits = torch.zeros(2, vocab)
    logits[0, 4], logits[0, 5] = 9.0, 8.0  # after w3: w4 (forbidden) beats w5
    logits[1, 7] = 9.0  # after w5: w7
    greedy = SamplingParams(temperature=0)
    compiler = GrammarCompiler(tok, vocab)

    def state(params, grammar=None) -> SamplerState:  # noqa: ANN001
        # The sampled token is in the output, and accepted into the grammar, as the runner does.
        if grammar is not None:
            grammar.accept(3)
        return SamplerState(params, [9], torch.Generator().manual_seed(0), [3], grammar)

    def odd_words() -> GrammarState:
        return GrammarState(compiler.new_matcher(StructuredOutputs(regex="(w[13579]){1,40}")))

    free = ModelRunnerOutput(sampled={"r": 3})
    verify_drafts(logits.clone(), spec, free, {"r": state(greedy)}, Sampler())
    assert free.bonus == {"r": [4]}  # w4 ≠ draft w5: the run ends

    grammar = odd_words()
    constrained = ModelRunnerOutput(sampled={"r": 3})
    verify_drafts(logits.clone(), spec, constrained, {"r": state(greedy, grammar)}, Sampler())
    assert constrained.bonus == {"r": [5, 7]}  # w5 (allowed) = draft 2, then w7
    assert grammar.num_accepted == 3

    # Sampled at temperature 1: w4 holds ~73% of row 1's mass, yet no draw may take it.
    for seed in range(10):
        grammar = odd_words()
        st = state(SamplingParams(temperature=1.0, seed=seed), grammar)
        st.generator.manual_seed(seed)
        drawn = ModelRunnerOutput(sampled={"r": 3})
        verify_drafts(logits.clone(), spec, drawn, {"r": st}, Sampler())
        bonus = drawn.bonus["r"]  # each one accepted by the grammar (accept raises otherwise)
        assert bonus[0] != 4 and grammar.num_accepted == 1 + len(bonus)


def test_bitmask_op_matches_torch():
    """The C++ masking op and the torch fallback remove exactly the same tokens."""
    from dsinfer.layers.kernels.cpu_build import load_cpu_ops
    from dsinfer.worker.grammar_mask import apply_bitmask

    assert load_cpu_ops() is None, "the fused CPU kernels should build on this machine"
    vocab = 1000  # not a multiple of 32: the last word is partial
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 32), dtype=torch.int32, generator=gen)
    bitmask[1] = -1  # a row with everything allowed
    logits = torch.randn(5, vocab, generator=gen)
    got = logits.clone()
    apply_bitmask(got, bitmask)
    want = logits.masked_fill(~allowed_tokens(bitmask, vocab), float("-inf"))
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1])
