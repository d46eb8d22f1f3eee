"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from dsinfer.sampling import split_samples, truncated_prompt
from dsinfer.server.errors import APIError
from dsinfer.server.metrics import ServerMetrics, labels_of
from dsinfer.server.protocol import ChatCompletionRequest
from dsinfer.server.reasoning import ReasoningParser, split_reasoning
from dsinfer.server.serving import (
    ChoiceState,
    ServedModel,
    Timing,
    chat_logprobs,
    check_token_fields,
    chunker,
    new_id,
    stream_error,
    usage,
)
from dsinfer.server.streams import (
    EngineStreamingResponse,
    fan_out,
    open_streams,
    until_disconnected,
)
from dsinfer.server.tool_parsers import parser_for
from dsinfer.server.tools import (
    ToolOutput,
    needs_fallback_prompt,
    prepare_messages,
    with_fallback_prompt,
)

# Names the chat template is rendered with; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


def _render(served: ServedModel, body: ChatCompletionRequest) -> tuple[list[int], str]:
    """(prompt ids, prompt text) through the model's chat template."""
    kwargs = dict(body.chat_template_kwargs or {})
    if clash := sorted(
        _RESERVED_TEMPLATE_ARGS & set(kwargs) | set(served.tokenizer.special_tokens) & set(kwargs)
    ):
        raise APIError(
            400, f"chat_template_kwargs may not set {clash[0]!r}", param="chat_template_kwargs"
        )
    template = served.tokenizer.chat_template
    try:
        messages = prepare_messages([m.for_template() for m in body.messages], template)
        if body.tool_mode() is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
            kwargs["tools"] = tools
            if needs_fallback_prompt(template):
                messages = with_fallback_prompt(messages, tools)
        text = served.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, **kwargs
        )
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    if body.continue_final_message:
        text = _open_final_turn(text, messages[-1]["content"])
    return served.tokenizer.encode(text, add_special_tokens=False), text


def _open_final_turn(text: str, final: str) -> str:
    """The rendered conversation cut right after the final assistant message's text, so the
    model continues that message instead of closing it (the end-of-turn marks are dropped)."""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise APIError(
            400,
            "continue_final_message: the chat template does not write the final assistant "
            "message verbatim, so it cannot be continued",
            param="continue_final_message",
        )
    return text[: at + len(final)]


def _tool_output(served: ServedModel, body: ChatCompletionRequest) -> ToolOutput | None:
    mode = body.tool_mode()
    if mode is None:
        return None
    named = body.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
    return ToolOutput(mode, parser_for(served.tokenizer.chat_template), named)


def _message(
    served: ServedModel, body: ChatCompletionRequest, st: ChoiceState, prompt_text: str
) -> dict:
    """The choice's message; sets st.finish_reason to "tool_calls" when it calls tools."""
    msg: dict = {"role": "assistant", "content": st.text}
    if served.reasoning:
        reasoning, msg["content"] = split_reasoning(st.text, prompt_text[-32:])
        msg["reasoning_content"] = reasoning
    tools = _tool_output(served, body)
    if tools is not None:
        content, calls = tools.parse(msg["content"])
        if calls:
            msg["content"] = content
            msg["tool_calls"] = [c.as_openai() for c in calls]
            if st.finish_reason == "stop":
                st.finish_reason = "tool_calls"
    return msg


async def chat_completion(
    served: ServedModel, body: ChatCompletionRequest, metrics: ServerMetrics, request: Request
) -> Any:
    check_token_fields(served, body)
    ids, prompt_text = _render(served, body)
    ids = truncated_prompt(ids, body.truncate_prompt_tokens)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    max_tokens = served.check_lengths(len(ids), requested, param, "messages")
    top = body.top_logprobs if body.top_logprobs is not None else 0
    structured = served.constraint(body)
    try:
        params = body.sampling(max_tokens, top if body.logprobs else None, structured=structured)
    except ValueError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None
    params = served.with_prediction_ids(params)
    all_params = split_samples(params, body.n)
    rid = new_id("chatcmpl")
    metrics.prompt_tokens.labels(*labels_of(served)).inc(len(ids))
    timing = Timing(metrics, served, request, rid, len(ids), prompt_text)
    streams = open_streams(served, ids, all_params, rid)
    if body.stream:
        gen = _stream(served, body, ids, prompt_text, streams, rid, timing)
        return EngineStreamingResponse(gen, streams)
    job = _full(served, body, ids, prompt_text, streams, rid, timing)
    return await until_disconnected(request, job, streams)


async def _full(served, body, ids, prompt_text, streams, rid, timing) -> dict:  # noqa: ANN001
    choices = [ChoiceState(i) for i in range(len(streams))]
    async for i, out in fan_out(streams):
        c = out.outputs[0]
        timing.tokens(len(c.delta_token_ids))
        st = choices[i]
        st.track(out)
        st.text, st.token_ids, st.finish_reason = c.text, c.token_ids, c.finish_reason
        st.logprobs = c.logprobs or []
    response = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": [
            {
                "index": st.index,
                # Before finish_reason: a message that calls tools makes it "tool_calls".
                "message": _message(served, body, st, prompt_text),
                "logprobs": chat_logprobs(served.tokenizer, st.logprobs) if body.logprobs else None,
                "finish_reason": st.finish_reason,
            }
            for st in choices
        ],
        "usage": _usage(len(ids), choices),
    }
    timing.done(choices)
    return response


def _usage(n_prompt: int, choices: list[ChoiceState]) -> dict:
    return usage(n_prompt, sum(len(c.token_ids) for c in choices), choices)


async def _stream(served, body, ids, prompt_text, streams, rid, timing) -> AsyncIterator[str]:  # noqa: ANN001
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk = chunker("chat.completion.chunk", served, rid, include_usage)

    states = [ChoiceState(i) for i in range(len(streams))]
    parsers = [ReasoningParser(prompt_text[-32:]) for _ in states] if served.reasoning else None
    tools = [_tool_output(served, body) for _ in states]
    called = [False for _ in states]
    for st in states:
        yield chunk(
            [
                {
                    "index": st.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
    try:
        async for i, out in fan_out(streams):
            c = out.outputs[0]
            timing.tokens(len(c.delta_token_ids))
            st = states[i]
            st.track(out)
            st.token_ids = c.token_ids
            new_lps = (c.logprobs or [])[len(st.logprobs) :]
            st.logprobs = c.logprobs or []
            delta: dict = {"content": c.delta_text}
            if parsers is not None:
                reasoning, content = parsers[i].feed(c.delta_text, final=out.finished)
                delta = {"content": content} if content else {}
                if reasoning:
                    delta["reasoning_content"] = reasoning
            if (tool := tools[i]) is not None:
                content, calls = tool.feed(delta.pop("content", ""), final=out.finished)
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = calls
                    called[i] = True
            if (
                delta.get("content")
                or delta.get("reasoning_content")
                or new_lps
                or delta.get("tool_calls")
            ):
                lp = chat_logprobs(served.tokenizer, new_lps) if body.logprobs else None
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": delta,
                            "logprobs": lp,
                            "finish_reason": None,
                        }
                    ]
                )
            if out.finished:
                finish = (
                    "tool_calls" if called[i] and c.finish_reason == "stop" else c.finish_reason
                )
                st.finish_reason = finish
                yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}])
    except Exception as e:  # refused, failed alone, or the engine stopped: said in the stream
        yield stream_error(e)
    timing.done(states)
    if include_usage:
        yield chunk([], _usage(len(ids), states))
    yield "data: [DONE]\n\n"
