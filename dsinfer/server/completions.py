"""POST /v1/completions (prompt as text, token ids, or a list of either)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from dsinfer.sampling import check_token_ids, split_samples, truncated_prompt
from dsinfer.server.errors import APIError
from dsinfer.server.metrics import ServerMetrics, labels_of
from dsinfer.server.protocol import CompletionRequest
from dsinfer.server.serving import (
    ChoiceState,
    ServedModel,
    Timing,
    check_token_fields,
    chunker,
    completion_logprobs,
    new_id,
    stream_error,
    usage,
)
from dsinfer.server.streams import (
    EngineStreamingResponse,
    RequestStream,
    close_all,
    fan_out,
    open_streams,
    until_disconnected,
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
    check_token_fields(served, body)
    prompts = body.prompts()
    if body.stream and len(prompts) > 1:
        raise APIError(
            400, "streaming takes one prompt; send a list without stream", param="prompt"
        )
    structured = served.constraint(body)
    jobs = []
    for p_index, prompt in enumerate(prompts):
        ids = truncated_prompt(_encode(served, prompt), body.truncate_prompt_tokens)
        max_tokens = served.check_lengths(len(ids), body.max_tokens, "max_tokens")
        plp = body.logprobs if (body.echo and body.logprobs is not None) else None
        try:
            params = body.sampling(
                max_tokens, body.logprobs, prompt_logprobs=plp, structured=structured
            )
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        params = served.with_prediction_ids(params)
        jobs.append((p_index, ids, split_samples(params, body.n)))
        metrics.prompt_tokens.labels(*labels_of(served)).inc(len(ids))
    rid = new_id("cmpl")
    n_prompt = sum(len(ids) for _, ids, _ in jobs)
    prompt_text = "\n".join(p for p in prompts if isinstance(p, str)) or None
    timing = Timing(metrics, served, request, rid, n_prompt, prompt_text)
    # Every prompt's requests go to the engine now, so a list of prompts runs as one batch.
    opened: list[RequestStream] = []
    try:
        for p_index, ids, all_params in jobs:
            sub_rid = rid if len(jobs) == 1 else f"{rid}-{p_index}"
            opened += open_streams(served, ids, all_params, sub_rid)
    except BaseException:
        close_all(opened)
        raise
    if body.stream:
        _, ids, all_params = jobs[0]
        gen = _stream(served, body, ids, opened, rid, timing)
        return EngineStreamingResponse(gen, opened)
    streams_of, at = [], 0
    for _, _, all_params in jobs:
        streams_of.append(opened[at : at + len(all_params)])
        at += len(all_params)
    return await until_disconnected(
        request, _full(served, body, jobs, streams_of, rid, timing), opened
    )


def _choice_logprobs(served, body, ids, out, st: ChoiceState) -> dict | None:  # noqa: ANN001
    if body.logprobs is None:
        return None
    entries = []
    if body.echo:
        plps = out.prompt_logprobs or [None] * len(ids)
        entries += list(zip(ids, plps, strict=True))
    entries += [(e.token_id, e) for e in st.logprobs]
    return completion_logprobs(served.tokenizer, entries)


async def _full(served, body, jobs, streams_of, rid, timing) -> dict:  # noqa: ANN001
    choices_out: list[dict] = []
    all_states: list[ChoiceState] = []
    n_prompt = n_out = 0
    for (_, ids, all_params), streams in zip(jobs, streams_of, strict=True):
        states = [ChoiceState(i) for i in range(len(all_params))]
        all_states += states
        last = {}
        async for i, out in fan_out(streams):
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
    timing.done(all_states)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": choices_out,
        "usage": usage(n_prompt, n_out, all_states),
    }


async def _stream(served, body, ids, streams, rid, timing) -> AsyncIterator[str]:  # noqa: ANN001
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    chunk = chunker("text_completion", served, rid, include_usage)

    states = [ChoiceState(i) for i in range(len(streams))]
    if body.echo:
        echo_text = served.tokenizer.decode(ids)
        for st in states:
            yield chunk(
                [{"index": st.index, "text": echo_text, "logprobs": None, "finish_reason": None}]
            )
    try:
        async for i, out in fan_out(streams):
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
                st.finish_reason = c.finish_reason
                yield chunk(
                    [{"index": i, "text": "", "logprobs": None, "finish_reason": c.finish_reason}]
                )
    except Exception as e:  # refused, failed alone, or the engine stopped: said in the stream
        yield stream_error(e)
    timing.done(states)
    if include_usage:
        n_out = sum(len(s.token_ids) for s in states)
        yield chunk([], usage(len(ids), n_out, states))
    yield "data: [DONE]\n\n"
