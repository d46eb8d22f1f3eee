"""POST /v1/completions (prompt as text, token ids, or a list of either)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from dsinfer.sampling import check_token_ids, split_samples
from dsinfer.server.metrics import ServerMetrics
from dsinfer.server.protocol import APIError, CompletionRequest
from dsinfer.server.serving import (
    ChoiceState,
    ServedModel,
    Timing,
    chunker,
    completion_logprobs,
    fan_out,
    new_id,
    sse,
    until_disconnected,
    usage,
)


def _encode(served: ServedModel, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return served.tokenizer.encode(prompt)
    try:
        check_token_ids(prompt, served.tokenizer.vocab_size)
    except ValueError as e:
        raise APIError(400, f"prompt: {e}", param="prompt") from None
    return list(prompt)


async def completion(
    served: ServedModel, body: CompletionRequest, metrics: ServerMetrics, request: Request
) -> Any:
    if body.suffix:
        raise APIError(400, "'suffix' is not supported", param="suffix")
    prompts = body.prompts()
    if body.stream and len(prompts) > 1:
        raise APIError(
            400, "streaming takes one prompt; send a list without stream", param="prompt"
        )
    jobs = []
    for p_index, prompt in enumerate(prompts):
        ids = _encode(served, prompt)
        max_tokens = served.check_lengths(len(ids), body.max_tokens, "max_tokens")
        plp = body.logprobs if (body.echo and body.logprobs is not None) else None
        try:
            params = body.sampling(max_tokens, body.logprobs, prompt_logprobs=plp)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        jobs.append((p_index, ids, split_samples(params, body.n)))
        metrics.prompt_tokens.inc(len(ids), served.name)
    rid = new_id("cmpl")
    timing = Timing(metrics, served.name)
    if body.stream:
        _, ids, all_params = jobs[0]
        return StreamingResponse(
            _stream(served, body, ids, all_params, rid, timing), media_type="text/event-stream"
        )
    return await until_disconnected(request, _full(served, body, jobs, rid, timing))


def _choice_logprobs(served, body, ids, out, st: ChoiceState) -> dict | None:  # noqa: ANN001
    if body.logprobs is None:
        return None
    entries = []
    if body.echo:
        plps = out.prompt_logprobs or [None] * len(ids)
        entries += list(zip(ids, plps, strict=True))
    entries += [(e.token_id, e) for e in st.logprobs]
    return completion_logprobs(served.tokenizer, entries)


async def _full(served, body, jobs, rid, timing) -> dict:  # noqa: ANN001
    choices_out: list[dict] = []
    all_states: list[ChoiceState] = []
    n_prompt = n_out = 0
    for p_index, ids, all_params in jobs:
        states = [ChoiceState(i) for i in range(len(all_params))]
        all_states += states
        last = {}
        async for i, out in fan_out(served, ids, all_params, f"{rid}-{p_index}"):
            c = out.outputs[0]
            timing.tokens(len(c.delta_token_ids))
            st = states[i]
            st.text, st.token_ids, st.finish_reason = c.text, c.token_ids, c.finish_reason
            st.logprobs = c.logprobs or []
            st.track(out)
            last[i] = out
        n_prompt += len(ids)
        for st in states:
            text = st.text
            if body.echo:
                text = served.tokenizer.decode(ids) + text
            choices_out.append(
                {
                    "index": len(choices_out),
                    "text": text,
                    "logprobs": _choice_logprobs(served, body, ids, last[st.index], st),
                    "finish_reason": st.finish_reason,
                }
            )
            n_out += len(st.token_ids)
    timing.done()
    return {
        "id": rid,
        "object": "text_completion",
        "created": served.created,
        "model": served.name,
        "choices": choices_out,
        "usage": usage(n_prompt, n_out, all_states),
    }


async def _stream(served, body, ids, all_params, rid, timing) -> AsyncIterator[str]:  # noqa: ANN001
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    chunk = chunker("text_completion", served, rid, include_usage)

    states = [ChoiceState(i) for i in range(len(all_params))]
    if body.echo:
        echo_text = served.tokenizer.decode(ids)
        for st in states:
            yield chunk(
                [{"index": st.index, "text": echo_text, "logprobs": None, "finish_reason": None}]
            )
    try:
        async for i, out in fan_out(served, ids, all_params, rid):
            c = out.outputs[0]
            timing.tokens(len(c.delta_token_ids))
            st = states[i]
            st.track(out)
            new_lps = (c.logprobs or [])[len(st.logprobs) :]
            st.logprobs, st.token_ids = c.logprobs or [], c.token_ids
            if c.delta_text or new_lps:
                lp = None
                if body.logprobs is not None:
                    lp = completion_logprobs(served.tokenizer, [(e.token_id, e) for e in new_lps])
                yield chunk(
                    [{"index": i, "text": c.delta_text, "logprobs": lp, "finish_reason": None}]
                )
            if out.finished:
                yield chunk(
                    [{"index": i, "text": "", "logprobs": None, "finish_reason": c.finish_reason}]
                )
    except APIError as e:
        yield sse(e.body())
    except ValueError as e:
        yield sse(APIError(400, str(e)).body())
    timing.done()
    if include_usage:
        n_out = sum(len(s.token_ids) for s in states)
        yield chunk([], usage(len(ids), n_out, states))
    yield "data: [DONE]\n\n"
