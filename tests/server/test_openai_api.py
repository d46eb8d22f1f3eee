"""The OpenAI-compatible API through the real `openai` client against a real server."""

from __future__ import annotations

import math
import threading

import pytest

from dsinfer import SamplingParams
from tests.server.conftest import wait_idle

Q = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_stream_equals_nonstream_equals_llm(client, served, smol_llm):
    full = client.chat.completions.create(model="smollm2", messages=Q, temperature=0, max_tokens=40)
    text = full.choices[0].message.content
    assert text == "The capital of France is Paris."
    assert full.choices[0].finish_reason == "stop"
    ref = smol_llm.chat(Q, SamplingParams(temperature=0, max_tokens=40))[0]
    assert text == ref.outputs[0].text
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert full.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=Q,
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    wait_idle(served)


def test_finish_reason_length_and_stop_in_streams(client, served):
    full = client.chat.completions.create(
        model="smollm2", messages=Q, temperature=0, max_completion_tokens=3
    )
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 3
    chunks = list(
        client.chat.completions.create(
            model="smollm2", messages=Q, temperature=0, max_tokens=40, stop=["Paris"], stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is "
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(served)


def test_completions_stream_and_nonstream(client, served, smol_llm):
    prompt = "The quick brown fox"
    ref = smol_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    full = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=12)
    assert full.choices[0].text == ref.text
    assert full.choices[0].finish_reason == ref.finish_reason
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="smollm2", prompt=prompt, temperature=0, max_tokens=12, stream=True
        )
        if c.choices
    )
    assert streamed == ref.text
    many = client.completions.create(
        model="smollm2", prompt=[prompt, "Water boils at"], temperature=0, max_tokens=5
    )
    assert [c.index for c in many.choices] == [0, 1]
    wait_idle(served)


def test_echo_logprobs_give_prompt_perplexity(client, served, smol_llm):
    text = "Paris is the capital and most populous city of France."
    out = client.completions.create(
        model="smollm2", prompt=text, max_tokens=0, echo=True, logprobs=1
    )
    lps = out.choices[0].logprobs.token_logprobs
    assert lps[0] is None and len(lps) == out.usage.prompt_tokens
    assert out.choices[0].text == text
    ref = smol_llm.generate(text, SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    want = [e.logprob for e in ref.prompt_logprobs[1:]]
    assert max(abs(a - b) for a, b in zip(lps[1:], want, strict=True)) < 1e-3
    ppl = math.exp(-sum(lps[1:]) / len(lps[1:]))
    assert 1 < ppl < 1000
    wait_idle(served)


def test_chat_logprobs_n_and_seed(client, served):
    r = client.chat.completions.create(
        model="smollm2", messages=Q, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(
        len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content
    )
    a = client.chat.completions.create(
        model="smollm2", messages=Q, temperature=1.0, n=3, seed=7, max_tokens=8
    )
    b = client.chat.completions.create(
        model="smollm2", messages=Q, temperature=1.0, n=3, seed=7, max_tokens=8
    )
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 3
    wait_idle(served)


@pytest.mark.slow  # concurrency in make test: hot swap under streaming load, the protocol tests
def test_sixteen_concurrent_streams(client, served, smol_llm):
    prompts = [f"Write one sentence about the number {i}." for i in range(16)]
    want = [
        o.outputs[0].text
        for o in smol_llm.generate(
            [
                {
                    "prompt_token_ids": smol_llm.tokenizer.encode_chat(
                        [{"role": "user", "content": p}]
                    )
                }
                for p in prompts
            ],
            SamplingParams(temperature=0, max_tokens=12),
        )
    ]
    got: dict[int, str] = {}

    def run(i: int) -> None:
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": prompts[i]}],
            temperature=0,
            max_tokens=12,
            stream=True,
        )
        got[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(got) == list(range(16))
    same = sum(got[i] == want[i] for i in range(16))
    assert same >= 15, [(got[i], want[i]) for i in range(16) if got[i] != want[i]]
    wait_idle(served)


def test_predicted_output_gives_the_same_answer_and_counts_its_tokens(client, served):
    """OpenAI's `prediction`: the paragraph to repeat, as the prediction; the answer is the one
    without it, streamed or not, and usage says how much of the prediction was kept."""
    paragraph = (
        "The ferry was a flat wooden raft pulled across on a rope. In a good month it carried "
        "carts of wool, barrels of salted fish and a few cattle."
    )
    conv = [{"role": "user", "content": f"Repeat this text exactly:\n\n{paragraph}"}]
    ask = {"model": "smollm2", "messages": conv, "temperature": 0, "max_tokens": 40}
    plain = client.chat.completions.create(**ask)
    assert plain.usage.completion_tokens_details is None  # nothing drafted without it
    text = plain.choices[0].message.content
    for prediction in (paragraph, [{"type": "text", "text": paragraph}]):
        got = client.chat.completions.create(
            **ask, prediction={"type": "content", "content": prediction}
        )
        assert got.choices[0].message.content == text
        details = got.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= 10, details
        assert got.usage.completion_tokens == plain.usage.completion_tokens
    chunks = client.chat.completions.create(
        **ask, prediction={"type": "content", "content": paragraph}, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    # Logprobs: one entry a token, streamed in the chunks of the steps that kept drafts too.
    predicted = {"type": "content", "content": paragraph}
    full = client.chat.completions.create(**ask, prediction=predicted, logprobs=True)
    entries = full.choices[0].logprobs.content
    assert len(entries) == full.usage.completion_tokens  # (the last: the end-of-turn token)
    assert "".join(e.token for e in entries).startswith(text)
    chunks = client.chat.completions.create(**ask, prediction=predicted, logprobs=True, stream=True)
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    import openai

    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(**ask, prediction={"type": "audio", "content": "x"})
    assert bad.value.body["param"].startswith("prediction")
    wait_idle(served)
