"""Nothing silently ignored: every request field is honoured, refused with 400 naming it, or one
of the documented no-ops; unknown fields are 400 unless the server runs with --lenient-fields."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.chat import _open_final_turn
from dsinfer.server.errors import APIError
from dsinfer.server.protocol import ChatMessage
from dsinfer.server.request_fields import COMPLETIONS_ONLY_REFUSED, NOT_IMPLEMENTED
from tests.server.conftest import running_server, wait_idle

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def url(tiny_smol) -> Iterator[str]:
    with running_server(build_app({"tiny": tiny_smol}, ServerSettings())) as u:
        yield u


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _err(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _greedy(url: str, **extra: object) -> dict:
    body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = _post(url, "/v1/completions", body | extra)
    assert r.status_code == 200, r.text
    return r.json()


def test_unknown_fields_are_400_unless_lenient(url, tiny_smol):
    err = _err(_post(url, "/v1/completions", {"prompt": "a", "max_tokns": 3}))
    assert err["param"] == "max_tokns" and err["code"] == "unknown_field"
    assert "--lenient-fields" in err["message"]
    err = _err(_post(url, "/v1/chat/completions", {"messages": CHAT, "temprature": 0}))
    assert err["param"] == "temprature"
    err = _err(
        _post(url, "/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"x": 1}})
    )
    assert "stream_options" in err["message"]
    lenient = build_app({"tiny": tiny_smol}, ServerSettings(lenient_fields=True))
    with running_server(lenient) as u:
        r = _post(u, "/v1/completions", {"prompt": "a", "max_tokens": 2, "max_tokns": 3})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("field", sorted(NOT_IMPLEMENTED))
def test_fields_not_implemented_are_400_naming_them(url, field):
    err = _err(_post(url, "/v1/chat/completions", {"messages": CHAT, field: {"x": 1}}))
    assert err["param"] == field and err["code"] == "unsupported_field"
    assert field in err["message"]


@pytest.mark.parametrize("field", sorted(COMPLETIONS_ONLY_REFUSED))
def test_chat_only_fields_are_400_on_completions(url, field):
    err = _err(_post(url, "/v1/completions", {"prompt": "a", field: {"x": 1}}))
    assert err["param"] == field and "chat/completions" in err["message"]


def test_off_values_and_no_ops_are_accepted(url, tiny_smol):
    body = {
        "messages": CHAT,
        "max_tokens": 2,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "top_k": 0,  # vLLM: off
        "best_of": 1,
    }
    assert _post(url, "/v1/chat/completions", body).status_code == 200
    for path, extra in (
        ("/v1/chat/completions", {"echo": True}),
        ("/v1/chat/completions", {"prompt_logprobs": 2}),
        ("/v1/chat/completions", {"top_logprobs": 2}),
        ("/v1/completions", {"best_of": 3, "n": 1}),
        ("/v1/completions", {"stream_options": {"include_usage": True}}),
    ):
        base = {"messages": CHAT} if "chat" in path else {"prompt": "a"}
        _err(_post(url, path, base | extra))
    wait_idle(tiny_smol)


def test_logit_bias_bans_and_forces_tokens(url, tiny_smol):
    ref = _greedy(url, logprobs=3)
    first = ref["choices"][0]["logprobs"]["tokens"][0]
    first_id = tiny_smol.tokenizer.encode(first, add_special_tokens=False)[0]
    banned = _greedy(url, logprobs=3, logit_bias={str(first_id): -100})
    assert banned["choices"][0]["logprobs"]["tokens"][0] != first
    assert first not in banned["choices"][0]["logprobs"]["top_logprobs"][0]
    # +100 on a special token forces it; skip_special_tokens decides whether the text shows it.
    forced = {"logit_bias": {"1": 100}}
    assert _greedy(url, **forced)["choices"][0]["text"] == ""
    shown = _greedy(url, skip_special_tokens=False, **forced)["choices"][0]["text"]
    assert shown == "<|im_start|>" * 6
    err = _err(_post(url, "/v1/completions", {"prompt": "a", "logit_bias": {"99999999": 1}}))
    assert err["param"] == "logit_bias"
    _err(_post(url, "/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}))
    wait_idle(tiny_smol)


def test_stop_token_ids_and_include_stop_str(url, tiny_smol):
    ref = _greedy(url, logprobs=0)
    tokens = ref["choices"][0]["logprobs"]["tokens"]
    third = tiny_smol.tokenizer.encode(tokens[2], add_special_tokens=False)[0]
    first_at = next(
        i
        for i, t in enumerate(tokens)
        if tiny_smol.tokenizer.encode(t, add_special_tokens=False)[0] == third
    )
    out = _greedy(url, stop_token_ids=[third])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == first_at + 1
    text = ref["choices"][0]["text"]
    stop = next(t for t in tokens[2:] if t.strip())
    end = text.index(stop)
    assert _greedy(url, stop=[stop])["choices"][0]["text"] == text[:end]
    kept = _greedy(url, stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"]
    assert kept == text[: end + len(stop)]
    wait_idle(tiny_smol)


def test_truncate_prompt_tokens_keeps_the_prompts_end(url, tiny_smol):
    """vLLM's truncate_prompt_tokens: the last k prompt tokens run, as if sent alone."""
    ids = tiny_smol.tokenizer.encode("one two three four five six seven eight nine ten")
    tail = _greedy(url, prompt=ids[-4:])
    cut = _greedy(url, prompt=ids, truncate_prompt_tokens=4)
    assert cut["usage"]["prompt_tokens"] == 4
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]
    whole = _greedy(url, prompt=ids, truncate_prompt_tokens=len(ids) + 5)  # longer: no cut
    assert whole["usage"]["prompt_tokens"] == len(ids)
    echo = _greedy(url, prompt=ids, truncate_prompt_tokens=4, echo=True)
    assert echo["choices"][0]["text"].startswith(tiny_smol.tokenizer.decode(ids[-4:]))
    chat = {"messages": [{"role": "system", "content": "Be brief. " * 20}, *CHAT]}
    r = _post(url, "/v1/chat/completions", chat | {"max_tokens": 2, "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8, r.text
    err = _err(_post(url, "/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 0}))
    assert err["param"] == "truncate_prompt_tokens"
    wait_idle(tiny_smol)


def test_developer_role_renders_as_system(url):
    def tokens(role: str) -> list[int]:
        msgs = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        r = _post(url, "/tokenize", {"messages": msgs})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert tokens("developer") == tokens("system")


def test_turn_fields_reach_the_template():
    msg = ChatMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}], "name": "bot"}
    )
    assert msg.for_template() == {
        "role": "assistant",
        "content": None,  # a tool-calling turn has no content: templates test for None
        "tool_calls": [{"id": "c1"}],
        "name": "bot",
    }


def test_continue_final_message(url, tiny_smol):
    msgs = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ]
    body = {"messages": msgs, "max_tokens": 3, "add_generation_prompt": False}
    closed = _post(url, "/v1/chat/completions", body).json()
    opened = _post(url, "/v1/chat/completions", body | {"continue_final_message": True}).json()
    # The open turn lacks the end-of-turn mark ("<|im_end|>\n": 2 tokens) the closed one has.
    assert closed["usage"]["prompt_tokens"] - opened["usage"]["prompt_tokens"] == 2
    _err(_post(url, "/v1/chat/completions", {"messages": msgs, "continue_final_message": True}))
    err = _err(
        _post(
            url,
            "/v1/chat/completions",
            {"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True},
        )
    )
    assert "final assistant message" in err["message"]
    with pytest.raises(APIError):
        _open_final_turn("<s>user: hi</s>", "not there")
    wait_idle(tiny_smol)


def test_chat_template_kwargs(url):
    body = {"messages": CHAT, "max_tokens": 1}
    ok = _post(url, "/v1/chat/completions", body | {"chat_template_kwargs": {"unused_flag": True}})
    assert ok.status_code == 200, ok.text
    err = _err(
        _post(url, "/v1/chat/completions", body | {"chat_template_kwargs": {"messages": []}})
    )
    assert err["param"] == "chat_template_kwargs"


def test_created_is_the_request_time(url):
    before = int(time.time())
    a = _greedy(url)
    time.sleep(1.1)
    b = _greedy(url)
    assert before <= a["created"] < b["created"]


def test_unknown_routes_and_model_cards(url):
    err = _err(httpx.get(f"{url}/v1/nothing-here"), 404)
    assert err["code"] == "not_found" and "/v1/nothing-here" in err["message"]
    err = _err(httpx.get(f"{url}/v1/completions"), 405)
    assert err["code"] == "method_not_allowed"
    card = httpx.get(f"{url}/v1/models/tiny").json()
    assert card["id"] == "tiny" and card["object"] == "model"
    err = _err(httpx.get(f"{url}/v1/models/nope"), 404)
    assert err["code"] == "model_not_found"


def test_openapi_shows_the_real_request_schemas(url):
    doc = httpx.get(f"{url}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"messages", "logit_bias", "stop_token_ids", "continue_final_message"} <= set(chat)
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/CompletionRequest"
    assert "ChatMessage" in schemas  # nested models are components too


def test_openapi_lists_each_routes_errors_and_key(url):
    doc = httpx.get(f"{url}/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert {"400", "401", "404", "413", "429", "500", "503"} <= set(chat["responses"])
    error = chat["responses"]["400"]["content"]["application/json"]["schema"]
    assert error["$ref"] == "#/components/schemas/ErrorResponse"
    assert doc["components"]["schemas"]["ErrorResponse"]["required"] == ["error"]
    # This server answers 400 for any invalid request: FastAPI's 422 is not listed anywhere.
    assert not [
        p for p, ops in doc["paths"].items() for op in ops.values() if "422" in op["responses"]
    ]
    role = doc["components"]["schemas"]["ChatMessage"]["properties"]["role"]
    assert role["enum"] == ["system", "user", "assistant", "tool", "developer"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "security" not in doc["paths"]["/health"]["get"]
    answer = chat["responses"]["200"]["content"]
    assert answer["application/json"]["schema"]["$ref"] == "#/components/schemas/ChatCompletion"
    assert "text/event-stream" in answer
