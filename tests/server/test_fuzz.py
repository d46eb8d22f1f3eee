"""Property-based fuzzing of the HTTP API (hypothesis) against a real server and engine.

The engine runs a tiny random Llama behind SmolLM2's real byte-level tokenizer and chat
template, so every generated request goes the whole way (tokenizer, template, scheduler,
sampler) in milliseconds. Property: every answer is a non-5xx, or a 500 that names a
request-local failure (code "request_failed"); afterwards a normal request succeeds, /health
is 200 and no KV block is in use. `make test` runs a bounded number of examples; the `slow`
variant runs many more (its counts are in docs/robustness.md).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.serving import ServedModel
from tests.server.conftest import assert_still_serving, fuzz_settings, running_server

KEY = "fuzz-key"
STATUS: Counter[int] = Counter()

# -- strategies ---------------------------------------------------------------------------------
weird_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "人工智能", "<|im_start|>", "<|im_end|>", ""]),
    st.text(st.characters(codec="utf-8"), max_size=8),
)
ints = st.one_of(
    st.integers(-3, 70),
    st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, 1e-9]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, weird_text)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(weird_text, inner, max_size=3)
    ),
    max_leaves=8,
)
token_ids = st.lists(st.one_of(st.integers(0, 49151), ints), min_size=0, max_size=12)
content_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": weird_text}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", 3])}),
    json_values,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot", 7])},
    optional={"content": st.one_of(weird_text, st.lists(content_part, max_size=3), json_values)},
)
sampling = {
    "max_tokens": st.one_of(ints, st.none()),
    "temperature": floats,
    "top_p": floats,
    "top_k": ints,
    "min_p": floats,
    "n": ints,
    "seed": st.one_of(ints, st.none()),
    "stop": st.one_of(weird_text, st.lists(weird_text, max_size=10), json_values),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.just({"include_usage": True}), json_values),
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "repetition_penalty": floats,
    "ignore_eos": st.booleans(),
    "min_tokens": ints,
    "logprobs": st.one_of(ints, st.booleans()),
    "top_logprobs": ints,
    "user": weird_text,
    "model": st.sampled_from(["tiny", "nope", 3, None]),
    "echo": st.booleans(),
    "max_completion_tokens": ints,
    "truncate_prompt_tokens": st.one_of(ints, st.none()),
    "prediction": st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(["content", "audio", 3]),
                "content": st.one_of(weird_text, st.lists(content_part, max_size=3), json_values),
            }
        ),
        json_values,
    ),
}
completions = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            weird_text,
            st.lists(weird_text, max_size=3),
            token_ids,
            st.lists(token_ids, max_size=3),
            json_values,
        )
    },
    optional=sampling,
)
chat = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, min_size=0, max_size=3), json_values)},
    optional=sampling,
)
tokenize = st.fixed_dictionaries(
    {},
    optional={
        "prompt": weird_text,
        "messages": st.lists(message, max_size=2),
        "add_special_tokens": scalars,
    },
)
detokenize = st.fixed_dictionaries({"tokens": st.one_of(token_ids, json_values)})
requests = st.one_of(
    st.tuples(st.just("/v1/completions"), completions),
    st.tuples(st.just("/v1/chat/completions"), chat),
    st.tuples(st.just("/tokenize"), tokenize),
    st.tuples(st.just("/detokenize"), detokenize),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), json_values),
)


# -- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_server(tiny_smol) -> Iterator[tuple[str, ServedModel]]:
    app = build_app({"tiny": tiny_smol}, ServerSettings(api_key=KEY, max_queued_requests=64))
    with running_server(app) as url:
        yield url, tiny_smol


def _send(url: str, path: str, body: object) -> None:
    raw = json.dumps(body, allow_nan=True, ensure_ascii=True)  # \ud800 travels as an escape
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.stream("POST", f"{url}{path}", content=raw, headers=headers, timeout=60) as r:
        text = r.read().decode("utf-8", "replace")
    STATUS[r.status_code] += 1
    if r.status_code >= 500:
        err = json.loads(text).get("error", {})
        assert r.status_code == 500 and err.get("code") == "request_failed", (path, body, text)
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: {"):
                err = json.loads(line[6:]).get("error")
                if err is not None:  # an error inside a stream: never the server's own fault
                    ok = err["type"] != "server_error" or err["code"] == "request_failed"
                    assert ok, (path, body, err)


def _fuzz(fuzz_server, examples: int) -> None:  # noqa: ANN001
    url, served = fuzz_server

    @fuzz_settings(examples)
    @given(requests)
    def one(req: tuple[str, object]) -> None:
        _send(url, *req)

    one()
    assert_still_serving(url, served, KEY)
    print(f"fuzz statuses: {dict(sorted(STATUS.items()))}")


def test_fuzzed_requests_never_break_the_server(fuzz_server):
    _fuzz(fuzz_server, examples=int(os.environ.get("DSINFER_FUZZ_EXAMPLES", "60")))


@pytest.mark.slow
def test_fuzzed_requests_never_break_the_server_long(fuzz_server):
    _fuzz(fuzz_server, examples=int(os.environ.get("DSINFER_FUZZ_EXAMPLES", "5000")))
