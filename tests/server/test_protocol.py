"""The HTTP protocol over a scripted engine (tests/server/scripted_engine.py): validation, SSE
framing, errors, auth, disconnects, health and metrics. No model runs, so these take
milliseconds; what needs real tokens is in test_openai_api.py."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.server.conftest import API_KEY, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture()
def client(scripted_url):
    import openai

    return openai.OpenAI(base_url=f"{scripted_url}/v1", api_key=API_KEY, max_retries=0)


def _sse_events(url: str, path: str, body: dict) -> list[str]:
    """The raw `data:` payloads of one stream, checking the framing line by line."""
    events: list[str] = []
    with httpx.stream("POST", f"{url}{path}", headers=AUTH, json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n"), raw[-40:]
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        events.append(block[len("data: ") :])
    return events


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sse_framing_done_and_usage_chunk(scripted_url, scripted, path):
    body = {"max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    body |= {"prompt": "Hi"} if "chat" not in path else {"messages": Q}
    events = _sse_events(scripted_url, path, body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1  # one id for the whole stream
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    wait_idle(scripted)


def test_stream_text_equals_the_unstreamed_text(client, scripted):
    full = client.completions.create(model="smollm2", prompt="Hi", max_tokens=12)
    parts = client.completions.create(model="smollm2", prompt="Hi", max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in parts) == full.choices[0].text
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    stopped = client.completions.create(model="smollm2", prompt="Hi", max_tokens=40, stop=["a"])
    assert stopped.choices[0].finish_reason == "stop" and "a" not in stopped.choices[0].text
    wait_idle(scripted)


def test_disconnecting_clients_free_their_blocks(scripted_url, scripted):
    def run() -> None:
        body = {"prompt": "Tell me a story.", "max_tokens": 400, "stream": True}
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{scripted_url}/v1/completions", headers=AUTH, json=body) as r,
        ):
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    break  # leave mid-stream

    threads = [threading.Thread(target=run) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    wait_idle(scripted, timeout=10)  # aborted, not run to their 400 tokens (4 s each)
    assert scripted.engine.stats().kv_blocks_used == 0


def test_health_metrics_models_tokenize(scripted_url, client):
    client.chat.completions.create(model="smollm2", messages=Q, max_tokens=2)  # a "length"
    assert httpx.get(f"{scripted_url}/health").status_code == 200
    h = {"Authorization": f"Bearer {API_KEY}"}
    models = httpx.get(f"{scripted_url}/v1/models", headers=h).json()
    assert models["data"][0]["id"] == "smollm2" and models["data"][0]["max_model_len"] == 8192
    tok = httpx.post(f"{scripted_url}/tokenize", headers=h, json={"prompt": "人工智能"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    back = httpx.post(
        f"{scripted_url}/detokenize", headers=h, json={"tokens": tok["tokens"]}
    ).json()
    assert back["prompt"] == "人工智能"
    text = httpx.get(f"{scripted_url}/metrics").text
    for name in (
        'dsinfer:time_to_first_token_seconds_bucket{le="0.005",model_name="smollm2",version=""}',
        'dsinfer:kv_blocks_free{model_name="smollm2",version=""}',
        "dsinfer:kv_cache_usage_perc",
        "dsinfer:prefix_cache_hits_total",
        "dsinfer:prefix_cache_queries_total",
        "dsinfer:num_preemptions_total",
        "dsinfer:prompt_tokens_total",
        "dsinfer:generation_tokens_total",
        'dsinfer:http_requests_total{route="/v1/chat/completions",status="200"}',
        'dsinfer:request_success_total{finished_reason="length",model_name="smollm2"',
        "dsinfer:e2e_request_latency_seconds",
        "dsinfer:inter_token_latency_seconds",
        "dsinfer:num_requests_waiting",
        "dsinfer:memory_bandwidth_utilization",
        "dsinfer:flops_utilization",
        "process_resident_memory_bytes",
    ):
        assert name in text, name


def test_auth_required_on_v1(scripted_url):
    r = httpx.post(f"{scripted_url}/v1/chat/completions", json={"messages": Q})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{scripted_url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


LONG = "word " * 9000
BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"\xff\xfe{}", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": Q, "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": Q, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": Q, "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": Q, "temperature": 7}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": Q, "n": 1000}, 400, "n"),
    ("/v1/chat/completions", {"messages": Q, "model": "gpt-17"}, 404, "model"),
    ("/v1/completions", {"prompt": LONG[:60000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x" * 70000}, 413, None),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input_gets_openai_error_then_server_still_serves(
    scripted_url, client, path, body, status, param
):
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    if isinstance(body, bytes):
        r = httpx.post(f"{scripted_url}{path}", content=body, headers=h)
    else:
        r = httpx.post(f"{scripted_url}{path}", json=body, headers=h, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param, err
    if status == 400 and param == "prompt" and "context" in err["message"]:
        assert "8192" in err["message"]
    ok = client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
