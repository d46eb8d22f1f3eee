"""Structured outputs through the real server and the `openai` client: every output parses and
validates against its schema (or is cut by max_tokens with finish_reason "length"), streamed or
not, greedy or sampled, batched with unconstrained requests that stay byte-identical.

The model is a tiny random Llama behind SmolLM2's real tokenizer: its raw choices are noise, so
only the grammar makes the output valid — the test cannot pass by the model being good.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from dsinfer.server.api import ServerSettings, build_app
from tests.server.conftest import running_server, wait_idle

S = {"type": "string", "maxLength": 8}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"risk": {"enum": ["low", "medium", "high"]}}, "required": ["risk"]},
    {"type": "object", "properties": {"risk": {"enum": ["low", "high"]}, "reasons": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}, "required": ["risk", "reasons"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 6}}, "required": ["ok", "note"]},
    {"type": "object", "properties": {"patient": {"type": "object", "properties": {"name": S, "dob": {"type": "string", "format": "date"}}, "required": ["name", "dob"]}}, "required": ["patient"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"a": S, "b": S}, "required": ["a"]},
    {"$defs": {"item": {"type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["sku", "qty"]}}, "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2}}, "required": ["items"]},
    {"type": "object", "properties": {"kind": {"const": "order"}, "id": {"type": "integer", "minimum": 1000, "maximum": 9999}}, "required": ["kind", "id"]},
    {"anyOf": [{"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}, {"type": "object", "properties": {"no": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["no"]}]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"t": {"type": "number", "exclusiveMinimum": 0, "maximum": 10}}, "required": ["t"]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {"type": "object", "properties": {"nested": {"type": "object", "properties": {"deeper": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["x"]}}, "required": ["deeper"]}}, "required": ["nested"]},
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 5}}, "required": ["name"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "hint": S}, "required": ["level", "hint"]},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}], "items": False}}, "required": ["pair"]},
    {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 12}, "words": {"type": "integer", "minimum": 0, "maximum": 50}}, "required": ["summary", "words"]},
]  # fmt: skip
MAX_TOKENS = 96
PROMPT = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def url(tiny_smol) -> Iterator[str]:
    with running_server(build_app({"tiny": tiny_smol}, ServerSettings())) as u:
        yield u


@pytest.fixture()
def oai(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def _valid(text: str, finish: str | None, schema: dict) -> bool:
    """Complete outputs validate; an output cut by max_tokens is allowed to be incomplete."""
    if finish == "length":
        return True
    assert finish == "stop", finish
    jsonschema.validate(json.loads(text), schema)
    return True


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_output_validates(oai, tiny_smol, index):
    schema = SCHEMAS[index]
    finished = 0
    for temperature, n in ((0.0, 1), (1.0, 3)):
        r = oai.chat.completions.create(
            model="tiny", messages=PROMPT, response_format=_fmt(schema),
            temperature=temperature, n=n, seed=index, max_tokens=MAX_TOKENS,
        )  # fmt: skip
        for c in r.choices:
            assert _valid(c.message.content, c.finish_reason, schema)
            finished += c.finish_reason == "stop"
    # Streamed: the deltas reassemble into a valid document too.
    stream = oai.chat.completions.create(
        model="tiny", messages=PROMPT, response_format=_fmt(schema), temperature=1.0,
        seed=100 + index, max_tokens=MAX_TOKENS, stream=True,
    )  # fmt: skip
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert _valid(text, finish, schema)
    finished += finish == "stop"
    assert finished >= 3, "most outputs should complete within max_tokens"
    wait_idle(tiny_smol)


def test_constrained_and_free_requests_share_a_batch(oai, url):
    """Unconstrained requests batched with constrained ones give exactly the tokens they give
    alone: the mask touches only its own rows."""
    free = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{url}/v1/completions", json=free, timeout=60).json()["choices"][0]["text"]

    def constrained(i: int) -> str:
        body = free | {"ignore_eos": False, "temperature": 1.0, "seed": i, "max_tokens": 64,
                       "response_format": _fmt(SCHEMAS[i % len(SCHEMAS)])}  # fmt: skip
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(constrained, i) for i in range(6)]
        frees = [pool.submit(httpx.post, f"{url}/v1/completions", json=free, timeout=60)]
        frees += [pool.submit(httpx.post, f"{url}/v1/completions", json=free, timeout=60)]
        for i, f in enumerate(futures):
            c = f.result()
            assert _valid(c["text"], c["finish_reason"], SCHEMAS[i % len(SCHEMAS)])
        for f in frees:
            assert f.result().json()["choices"][0]["text"] == alone


def test_vllm_fields_choice_regex_grammar(url):
    def complete(**extra: object) -> dict:
        body = {"prompt": "Pick:", "max_tokens": 16, "temperature": 1.0, "seed": 3} | extra
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    for _ in range(3):
        assert complete(guided_choice=["approve", "decline", "review"])["text"] in (
            "approve", "decline", "review",
        )  # fmt: skip
    c = complete(guided_regex=r"[0-9]{3}-[A-Z]{2}")
    assert c["finish_reason"] == "stop" and len(c["text"]) == 6 and c["text"][3] == "-", c
    c = complete(guided_grammar='root ::= "yes" | "no" | ("maybe " [0-9])')
    assert c["text"] in ("yes", "no") or c["text"].startswith("maybe "), c
    c = complete(structured_outputs={"choice": ["red", "green"]})
    assert c["text"] in ("red", "green")
    c = complete(structured_outputs={"json": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}}, max_tokens=32)  # fmt: skip
    assert isinstance(json.loads(c["text"])["k"], bool)
    c = complete(response_format={"type": "json_object"}, max_tokens=64)
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(c["text"]), dict)
    c = complete(guided_json=json.dumps({"enum": [1, 2]}))
    assert c["text"] in ("1", "2")


def test_logprobs_are_those_of_the_constrained_distribution(url):
    body = {
        "model": "tiny", "messages": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": True,
        "top_logprobs": 5, "guided_choice": ["yes", "no"],
    }  # fmt: skip
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    first = r["choices"][0]["logprobs"]["content"][0]
    alts = {t["token"] for t in first["top_logprobs"]}
    assert alts <= {"yes", "no", "y", "n", "ye"}, alts  # only grammar tokens, no -inf entries
    total = sum(2.718281828 ** t["logprob"] for t in first["top_logprobs"])
    assert total == pytest.approx(1.0, abs=1e-3)  # the mass is on the allowed tokens


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"response_format": _fmt({"type": "object", "allOf": [{"type": "object"}]})}, "response_format", "allOf"),
        ({"guided_json": {"type": "string", "format": "credit-card"}}, "guided_json", "credit-card"),
        ({"guided_json": {"not": {"type": "string"}}}, "guided_json", "'not'"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "parenthesis"),
        ({"guided_json": {"$ref": "#"}}, "guided_json", "admits no text"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
        ({"guided_json": "{not json"}, None, "not valid JSON"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, None, "both constrain"),
        ({"guided_choice": ["a"], "ignore_eos": True}, None, "ignore_eos"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format", None),
        ({"guided_decoding_backend": "outlines", "guided_choice": ["a"]}, "guided_decoding_backend", None),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_field(url, extra, param, says):
    body = {"prompt": "x", "max_tokens": 4} | extra
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    if says is not None:
        assert says in err["message"], err
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # and the server keeps serving


# Admits `{"a":` and then nothing: "a" is required and its schema is only itself.
DEAD_END = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}


def test_a_constraint_that_dead_ends_is_the_requests_400_not_a_500(url):
    """A schema that compiles and admits a first token but no complete text ends its request
    where the grammar allows nothing more: a 400 naming the constraint (an error event in a
    stream), counted as the request's fault; the engine serves on."""
    body = {"prompt": "x", "max_tokens": 16, "guided_json": DEAD_END}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsatisfiable_constraint", err
    assert "admits no token after" in err["message"], err
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60
    ) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert events[-1]["error"]["code"] == "unsatisfiable_constraint", events[-1]
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["engines"]["tiny"]["restarts"] == 0, health
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_text_format_is_no_constraint(url):
    body = {"prompt": "x", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    text_fmt = body | {"response_format": {"type": "text"}}
    same = httpx.post(f"{url}/v1/completions", json=text_fmt, timeout=60).json()
    assert plain["choices"][0]["text"] == same["choices"][0]["text"]


def test_grammar_compiled_once_per_schema(url, tiny_smol):
    grammars = tiny_smol.grammars
    schema = {"type": "object", "properties": {"cache_probe": {"type": "boolean"}}, "required": ["cache_probe"]}  # fmt: skip
    for _ in range(3):
        body = {"prompt": "x", "max_tokens": 16, "guided_json": schema}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    assert grammars is not None
    assert sum(1 for spec in grammars._cache if spec.json and "cache_probe" in spec.json) == 1
