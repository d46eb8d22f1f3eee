"""Grammars for constrained decoding, compiled by xgrammar once per constraint and cached.

xgrammar (the library vLLM and SGLang use) is imported on first use: it brings transformers
with it (~3 s), which a server that never sees a structured request should not pay.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from dsinfer.structured.schema_check import check_json_schema
from dsinfer.structured.spec import StructuredOutputs
from dsinfer.tokenizer import Tokenizer

CACHE_SIZE = 256


class GrammarCompiler:
    """StructuredOutputs → xgrammar CompiledGrammar for one tokenizer and logits width.

    Thread-safe: the server compiles on a worker thread (so a bad schema is a 400 before the
    request is queued), the engine thread finds the result in the cache."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the vocabulary)
        self._compiler: Any = None
        self._info: Any = None  # xgrammar.TokenizerInfo
        self._cache: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self._control_tokens: list[int] | None = None

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar; ValueError naming what is wrong with the constraint."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                self.hits += 1
                return self._cache[spec]
        compiled = self._compile(spec)  # outside the lock: xgrammar compiles in parallel
        with self._lock:
            self.misses += 1
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, spec: StructuredOutputs) -> Any:
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec))

    def control_tokens(self) -> list[int]:
        """Tokens whose bytes hold a control character (< 0x20). xgrammar 0.2.8's JSON strings
        admit raw control characters, which JSON forbids (they must be escaped); with compact
        separators no control byte is valid anywhere in JSON, so JSON rows ban these tokens."""
        self._xgrammar()
        info = self._info
        with self._lock:
            if self._control_tokens is None:
                special = set(info.special_token_ids)
                self._control_tokens = [
                    i
                    for i, token in enumerate(info.decoded_vocab)
                    if i not in special and any(b < 0x20 for b in token)
                ]
            return self._control_tokens

    def _xgrammar(self) -> Any:
        with self._lock:
            if self._compiler is None:
                self._info = _tokenizer_info(self.tokenizer, self.vocab_size)
                self._compiler = _new_compiler(self._info)
            return self._compiler

    def _compile(self, spec: StructuredOutputs) -> Any:
        compiled = self._compile_text(spec)
        if not self._admits_a_token(compiled):
            raise ValueError(
                f"the {spec.kind} constraint admits no text: no token can begin an output "
                "that satisfies it (a schema that refers only to itself, for example)"
            )
        return compiled

    def _admits_a_token(self, compiled: Any) -> bool:
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    def _compile_text(self, spec: StructuredOutputs) -> Any:
        compiler = self._xgrammar()
        kind = spec.kind
        try:
            if kind == "json" or kind == "json_object":
                schema = spec.schema()
                check_json_schema(schema)
                # Compact separators: no run of free whitespace for a sampler to wander in.
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                alternatives = " | ".join(_ebnf_literal(c) for c in spec.choice or ())
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(spec.grammar)
        except RuntimeError as e:  # xgrammar's parse errors: "[time] file:line: message"
            raise ValueError(f"the {kind} constraint does not compile: {_message(e)}") from None


def _tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> Any:
    import xgrammar

    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    # The vocabulary's encoding (byte-level BPE, SentencePiece byte fallback, raw) as
    # tokenizer.json describes it.
    meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
    return xgrammar.TokenizerInfo(
        encoded,
        vocab_type=meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=sorted(tokenizer.eos_token_ids),
        add_prefix_space=meta["add_prefix_space"],
    )


def _new_compiler(info: Any) -> Any:
    import xgrammar

    # Our own cache above keys on the constraint; xgrammar's would hold a second copy.
    return xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)


def _ebnf_literal(text: str) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are also xgrammar's EBNF string escapes.
    return json.dumps(text, ensure_ascii=False)


def _message(e: RuntimeError) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


_shared: dict[tuple[int, int], tuple[Tokenizer, GrammarCompiler]] = {}
_shared_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
    """One compiler (and cache) per tokenizer object and logits width, shared by the server
    and its engine."""
    key = (id(tokenizer), vocab_size)
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None or entry[0] is not tokenizer:
            entry = (tokenizer, GrammarCompiler(tokenizer, vocab_size))
            _shared[key] = entry
        return entry[1]
