"""Incremental detokenisation: UTF-8 safety and stop strings that never leak."""

from __future__ import annotations

import pytest

from dsinfer.engine.detokenizer import IncrementalDetokenizer
from dsinfer.sampling import SamplingParams
from dsinfer.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(smol_path):
    return load_tokenizer(smol_path)


def _stream(tok, text: str, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], SamplingParams(**kw))
    pieces = []
    for i, t in enumerate(ids):
        d.add_tokens([t], final=i == len(ids) - 1)
        pieces.append(d.take_delta(finished=i == len(ids) - 1 or d.stopped_by is not None))
        if d.stopped_by:
            break
    return pieces, d


def test_chinese_never_split(tok):
    text = "人工智能很有趣 — café ☕ 😀 done"
    ids = tok.encode(text)
    assert len(ids) > len(text) // 2  # byte-level pieces: characters span several tokens
    pieces, _ = _stream(tok, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_never_leaks(tok):
    pieces, d = _stream(tok, "Hello there. STOP and more text", stop=["STOP"])
    assert d.stopped_by == "STOP"
    assert "".join(pieces) == "Hello there. "
    assert all("S" not in p for p in pieces)


def test_stop_string_spanning_tokens_and_include(tok):
    pieces, d = _stream(tok, "abc<|xyz|> tail", stop=["c<|x"], include_stop_str_in_output=True)
    assert "".join(pieces) == "abc<|x"


def test_held_back_text_flushed_when_no_stop(tok):
    pieces, d = _stream(tok, "partial STO", stop=["STOP"])
    assert d.stopped_by is None
    assert "".join(pieces) == "partial STO"


def test_a_stop_string_inside_a_run_of_tokens_says_where_the_text_ended(tok):
    """Several ids at once (a step that verified drafts): add_tokens absorbs them up to the
    one whose text completes the stop string and says how many that was."""
    ids = tok.encode("Hello there. STOP and more text")
    upto = next(n for n in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:n]))
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"]))
    assert d.add_tokens(ids[:2]) == 2
    assert d.add_tokens(ids[2:]) == upto - 2 < len(ids) - 2
    assert d.stopped_by == "STOP" and d.text == "Hello there. "
    assert d.add_tokens(ids[-1:]) == 0  # nothing after the stop
