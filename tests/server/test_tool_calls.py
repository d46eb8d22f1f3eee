"""Tool calling: each family's syntax parsed, streamed deltas that reassemble to the whole
answer, DeepSeek-V3 and Qwen2.5 templates rendering tool conversations as transformers does, and
tool_choice "required" / a named function always giving a valid call through the real server."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator

import httpx
import jsonschema
import pytest

from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.chat import _render
from dsinfer.server.protocol import ChatCompletionRequest
from dsinfer.server.serving import ServedModel
from dsinfer.server.tool_parsers import (
    DeepSeekV3Parser,
    HermesParser,
    Llama3JsonParser,
    parser_for,
)
from dsinfer.server.tools import ToolOutput
from dsinfer.tokenizer import load_tokenizer
from tests.helpers import tokenizer_data_dir as _data_dir
from tests.server.conftest import running_server, serve_tiny_smol, wait_idle

ORDER = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "Find an order by its id",
        "parameters": {
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
                "include_items": {"type": "boolean"},
            },
            "required": ["order_id", "include_items"],
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Beijing", "Lagos"]}},
            "required": ["city"],
        },
    },
}
CONVERSATION = [
    {"role": "system", "content": "You are a support agent."},
    {"role": "user", "content": "Where is order AB1234?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "lookup_order",
                    "arguments": '{"order_id": "AB1234", "include_items": false}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'},
    {"role": "assistant", "content": "It has shipped."},
    {"role": "user", "content": "Thanks! 谢谢"},
]


# -- parsers -----------------------------------------------------------------------------------
def test_deepseek_v3_syntax():
    text = (
        "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>lookup_order\n"
        '```json\n{"order_id": "AB1234"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
        '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>"
    )
    content, calls = DeepSeekV3Parser().parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("lookup_order", {"order_id": "AB1234"}),
        ("get_weather", {"city": "Paris"}),
    ]
    assert DeepSeekV3Parser().parse("no calls here") == ("no calls here", [])
    # DeepSeek-V3.1's form: the name before the separator, bare JSON after it.
    v31 = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Beijing"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    content, calls = DeepSeekV3Parser().parse(v31)
    assert content is None and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Beijing"}


def test_hermes_and_llama3_syntax():
    text = (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lagos"}}\n</tool_call>'
    )
    content, calls = HermesParser().parse(text)
    assert content == "Sure." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Lagos"}
    assert HermesParser().parse("<tool_call>\nnot json\n</tool_call>")[1] == []  # stays text
    content, calls = Llama3JsonParser().parse(
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    )
    assert content is None and [c.name for c in calls] == ["a", "b"]
    assert Llama3JsonParser().parse("{not a call}")[1] == []


def test_parser_follows_the_template():
    assert parser_for("...<｜tool▁calls▁begin｜>...").name == "deepseek_v3"
    assert parser_for("...<tool_call>...").name == "hermes"
    assert parser_for(None).name == "hermes"  # the fallback prompt teaches hermes


@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_auto_deltas_reassemble(step):
    text = 'Checking.\n<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "AB1234"}}\n</tool_call>'
    whole_content, whole_calls = ToolOutput("auto", HermesParser()).parse(text)
    streamer = ToolOutput("auto", HermesParser())
    content, calls = "", []
    for i in range(0, len(text), step):
        piece = text[i : i + step]
        c, d = streamer.feed(piece, final=i + step >= len(text))
        content += c
        calls += d
    assert content.strip() == (whole_content or "").strip()
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in calls] == [
        (c.name, c.arguments) for c in whole_calls
    ]
    assert "<tool" not in content  # no fragment of the marker leaks into content


def test_streamed_required_array_gives_each_call_when_complete():
    text = '[{"name": "a", "arguments": {"s": "}]{"}}, {"name": "b", "arguments": {}}]'
    streamer = ToolOutput("required", None)
    got = []
    for ch in text:
        got += streamer.feed(ch, final=False)[1]
    assert [(d["index"], d["function"]["name"]) for d in got] == [(0, "a"), (1, "b")]
    assert json.loads(got[0]["function"]["arguments"]) == {"s": "}]{"}


# -- templates -----------------------------------------------------------------------------------
def _reference(name: str, tmp_path, ours):  # noqa: ANN001, ANN202
    from transformers import PreTrainedTokenizerFast

    with zipfile.ZipFile(_data_dir() / name / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", tmp_path)
    return PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"),
        chat_template=ours.chat_template,
        bos_token=ours.special_tokens.get("bos_token"),
        eos_token=ours.special_tokens.get("eos_token"),
    )


def _served(tok) -> ServedModel:  # noqa: ANN001
    return ServedModel("m", None, tok, 4096)  # type: ignore[arg-type]


def test_deepseek_v3_template_renders_tool_turns_like_transformers(tmp_path):
    """OpenAI writes a tool-calling turn with content null, which DeepSeek-V3's template tests
    for (`content is none`). transformers 5.24's apply_chat_template drops None-valued keys
    first and then fails on that turn, so the reference here is transformers' own compiled
    template (its jinja environment and filters) rendered over the same OpenAI messages."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    ours = load_tokenizer(_data_dir() / "deepseek-v3")
    body = ChatCompletionRequest(messages=CONVERSATION, tools=[ORDER, WEATHER])
    _, got = _render(_served(ours), body)
    want = _compile_jinja_template(ours.chat_template).render(
        messages=CONVERSATION,
        tools=[ORDER, WEATHER],
        add_generation_prompt=True,
        **ours.special_tokens,
    )
    assert got == want
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜>lookup_order" in got
    assert '<｜tool▁output▁begin｜>{"status": "shipped"}' in got


@pytest.mark.parametrize("name", ["deepseek-r1", "deepseek-v3.1"])
def test_deepseek_tool_templates_render_like_apply_chat_template(name, tmp_path):
    # These templates render a tool call beside content, so "" (which transformers keeps)
    # works with apply_chat_template itself.
    conv = json.loads(json.dumps(CONVERSATION))
    conv[2]["content"] = ""
    ours = load_tokenizer(_data_dir() / name)
    ref = _reference(name, tmp_path, ours)
    _, got = _render(_served(ours), ChatCompletionRequest(messages=conv, tools=[ORDER]))
    want = ref.apply_chat_template(conv, tools=[ORDER], tokenize=False, add_generation_prompt=True)
    assert got == want
    assert "lookup_order" in got and "<｜tool▁call▁begin｜>" in got


def test_qwen_template_gets_tools_and_argument_objects(tmp_path):
    ours = load_tokenizer(_data_dir() / "qwen-2.5")
    ref = _reference("qwen-2.5", tmp_path, ours)
    body = ChatCompletionRequest(messages=CONVERSATION, tools=[ORDER])
    _, got = _render(_served(ours), body)
    hf_conv = json.loads(json.dumps(CONVERSATION))
    call = hf_conv[2]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])  # transformers' convention: an object
    want = ref.apply_chat_template(
        hf_conv, tools=[ORDER], tokenize=False, add_generation_prompt=True
    )
    assert got == want
    assert '"name": "lookup_order"' in got and "<tools>" in got


def test_template_without_tools_gets_the_fallback_prompt(tiny_smol):
    body = ChatCompletionRequest(messages=CONVERSATION[:2], tools=[ORDER])
    _, text = _render(tiny_smol, body)
    assert "lookup_order" in text and "<tool_call>" in text
    none = ChatCompletionRequest(messages=CONVERSATION[:2], tools=[ORDER], tool_choice="none")
    assert "lookup_order" not in _render(tiny_smol, none)[1]


# -- through the server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory) -> Iterator[ServedModel]:
    """tiny_smol with room for the tool descriptions (1024 positions)."""
    served = serve_tiny_smol(tmp_path_factory.mktemp("tiny-tools"), 1024, 512, 16)
    yield served
    served.engine.shutdown()


@pytest.fixture(scope="module")
def url(tiny_long) -> Iterator[str]:
    with running_server(build_app({"tiny": tiny_long}, ServerSettings())) as u:
        yield u


def _chat(url: str, **body: object) -> httpx.Response:
    base = {
        "model": "tiny",
        "messages": CONVERSATION[:2],
        "max_tokens": 96,
        "tools": [ORDER, WEATHER],
    }
    return httpx.post(f"{url}/v1/chat/completions", json=base | body, timeout=60)


def _stream(url: str, **body: object) -> tuple[str, list[dict], str | None]:
    base = {
        "model": "tiny",
        "messages": CONVERSATION[:2],
        "max_tokens": 96,
        "tools": [ORDER, WEATHER],
    }
    content, calls, finish = "", {}, None
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=base | body | {"stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                content += c["delta"].get("content") or ""
                for d in c["delta"].get("tool_calls") or []:
                    slot = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                    if "id" in d:
                        assert d["type"] == "function" and d["id"].startswith("call_")
                        slot["name"] = d["function"]["name"]  # the name comes first
                    slot["arguments"] += d["function"].get("arguments") or ""
                finish = c.get("finish_reason") or finish
    return content, [calls[i] for i in sorted(calls)], finish


SCHEMAS = {"lookup_order": ORDER["function"]["parameters"], "get_weather": WEATHER["function"]["parameters"]}  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_required_always_gives_valid_calls(url, seed):
    r = _chat(url, tool_choice="required", temperature=1.0, seed=seed, max_tokens=160)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # A random model may go on adding calls until max_tokens: the complete ones are returned.
    assert choice["finish_reason"] in ("tool_calls", "length")
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] is None
    for call in calls:
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
        )
    # Streamed with the same seed: the deltas reassemble to the same calls.
    _, streamed, finish = _stream(
        url, tool_choice="required", temperature=1.0, seed=seed, max_tokens=160
    )
    assert finish == choice["finish_reason"]
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]


def test_named_choice_and_single_call_without_parallel(url, tiny_long):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = _chat(url, tool_choice=named, temperature=1.0, seed=seed).json()
        call = r["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Beijing", "Lagos")
        assert r["choices"][0]["finish_reason"] == "tool_calls"
        _, streamed, finish = _stream(url, tool_choice=named, temperature=1.0, seed=seed)
        assert streamed == [{"name": "get_weather", "arguments": call["function"]["arguments"]}]
    r = _chat(url, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=1)
    assert len(r.json()["choices"][0]["message"]["tool_calls"] or []) <= 1
    wait_idle(tiny_long)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tools": None, "tool_choice": "required"}, "needs tools"),
        ({"tools": [ORDER, ORDER]}, "unique"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "both constrain"),
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]}, "'not'"),
        ({"functions": [{"name": "f"}]}, "tools"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400(url, body, says):
    r = _chat(url, **body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"], r.json()
    assert "invalid ''" not in r.json()["error"]["message"]  # a rule across fields names none


def test_tool_turns_reach_a_template_without_tools_as_text(tiny_smol):
    body = ChatCompletionRequest(messages=CONVERSATION, tools=[ORDER], tool_choice="none")
    _, text = _render(tiny_smol, body)
    assert '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "AB1234"' in text
    assert '<|im_start|>user\n<tool_response>\n{"status": "shipped"}\n</tool_response>' in text
    assert "None" not in text
