"""Turning OpenAI requests into engine requests and engine outputs into OpenAI responses."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from dsinfer.engine.outputs import RequestOutput
from dsinfer.sampling import SamplingParams
from dsinfer.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRestartingError,
    RequestFailedError,
    RequestStream,
)
from dsinfer.server.metrics import ServerMetrics
from dsinfer.server.protocol import APIError
from dsinfer.tokenizer import Tokenizer
from dsinfer.worker.step_io import TokenLogprobs


@dataclass
class ServedModel:
    name: str
    engine: AsyncEngine
    tokenizer: Tokenizer
    max_model_len: int
    version: str | None = None
    reasoning: bool = False  # R1-style: split <think>…</think> into reasoning_content
    created: int = field(default_factory=lambda: int(time.time()))

    def check_lengths(
        self, n_prompt: int, max_tokens: int | None, param: str, prompt_param: str = "prompt"
    ) -> int:
        """Validate against the context; return the effective max_tokens. `prompt_param`
        is what the client calls the prompt ("messages" on chat)."""
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty: send at least one token", param=prompt_param)
        if n_prompt >= self.max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} "
                f"tokens, but the prompt has {n_prompt} tokens; shorten it",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = self.max_model_len - n_prompt
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise APIError(
                400,
                f"{param}={max_tokens} is too large: the prompt has {n_prompt} "
                f"tokens and this model's maximum context length is "
                f"{self.max_model_len}, so at most {room} can be generated",
                param=param,
                code="context_length_exceeded",
            )
        return max_tokens


@dataclass
class ChoiceState:
    """Accumulates one choice's output across deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    drafts: tuple[int, int] = (0, 0)  # speculative drafts (verified, accepted)

    def track(self, out: RequestOutput) -> None:
        """Take the per-request figures every delta carries."""
        if out.metrics is not None:
            self.drafts = (out.metrics.num_draft_tokens, out.metrics.num_accepted_draft_tokens)


class Timing:
    """Per-request latency bookkeeping for the metrics histograms."""

    def __init__(self, metrics: ServerMetrics, model: str) -> None:
        self.metrics, self.model = metrics, model
        self.start = time.perf_counter()
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start, self.model)
        else:
            self.metrics.itl.observe((now - self.last) / n, self.model)
        self.last = now
        self.metrics.generation_tokens.inc(n, self.model)

    def done(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start, self.model)


def open_streams(
    served: ServedModel, prompt_ids: list[int], params: list[SamplingParams], rid: str
) -> list[RequestStream]:
    """Submit one engine request per sample now (so admission counts them and they batch)."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(params):
            streams.append(
                served.engine.submit(prompt_ids, p, rid if len(params) == 1 else f"{rid}-{i}")
            )
    except BaseException:
        close_all(streams)
        raise
    return streams


def close_all(streams: Sequence[RequestStream]) -> None:
    for s in streams:
        s.close()


async def fan_out(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Merge the samples' streams; yield (choice index, delta output) as they arrive. Closing
    (or abandoning) the iterator aborts what has not finished."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await q.put((i, out))
            except BaseException as e:  # surfaced to the consumer below
                await q.put((i, e))
            finally:
                await q.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            live = len(tasks)
            while live:
                i, item = await q.get()
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        close_all(streams)


class EngineStreamingResponse(StreamingResponse):
    """A streamed answer that aborts its engine requests however the response ends — also
    when the client left before the body started, which never runs the body's own cleanup."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"X-Accel-Buffering": "no"}
        )
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self.streams)


def usage(n_prompt: int, n_out: int, choices: Sequence[ChoiceState] = ()) -> dict:
    """OpenAI usage; with speculative decoding, the drafts the model verified appear as
    completion_tokens_details accepted/rejected_prediction_tokens (OpenAI's names for
    predicted-output tokens)."""
    out = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    drafted = sum(c.drafts[0] for c in choices)
    if drafted:
        accepted = sum(c.drafts[1] for c in choices)
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return out


def chunker(kind: str, served: ServedModel, rid: str, include_usage: bool):  # noqa: ANN201
    """SSE chunk writer for one streamed response (`kind`: the OpenAI `object` value)."""

    def chunk(choices: list[dict], usage_: dict | None = None) -> str:
        obj = {
            "id": rid,
            "object": kind,
            "created": served.created,
            "model": served.name,
            "choices": choices,
        }
        if include_usage:
            obj["usage"] = usage_
        return sse(obj)

    return chunk


def token_text(tok: Tokenizer, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


def chat_logprobs(tok: Tokenizer, lps: list[TokenLogprobs]) -> dict:
    def entry(tid: int, lp: float) -> dict:
        s = token_text(tok, tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [
            {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, v) for t, v in e.top]}
            for e in lps
        ]
    }


def completion_logprobs(
    tok: Tokenizer, entries: list[tuple[int, TokenLogprobs | None]], offset0: int = 0
) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset0
    for tid, e in entries:
        s = token_text(tok, tid)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
        lps.append(None if e is None else e.logprob)
        tops.append(None if e is None else {token_text(tok, t): v for t, v in e.top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def as_api_error(exc: BaseException) -> BaseException:
    """The HTTP answer for what a handler or the engine raised; other exceptions unchanged
    (the app's last handler makes them a 500 and logs them)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestFailedError):
        return APIError(
            500,
            f"this request failed inside the engine (error id {exc.error_id}: {exc}); other "
            "requests were not affected. Report the error id with the request.",
            "server_error",
            code="request_failed",
        )
    if isinstance(exc, EngineRestartingError):
        return APIError(
            503,
            f"{exc}; retry the request",
            "server_error",
            code="engine_restarted",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "server_error", code="engine_dead")
    if isinstance(exc, ValueError):  # the engine refused it (e.g. larger than the KV pool)
        return APIError(400, str(exc))
    return exc


def stream_error(exc: BaseException) -> str:
    """An error inside a stream that has started: one SSE event with the OpenAI error body
    (the status line was sent already). Unknown exceptions are re-raised."""
    err = as_api_error(exc)
    if not isinstance(err, APIError):
        raise exc
    return sse(err.body())


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


async def until_disconnected(
    request: Request, coro: Awaitable[Any], streams: Sequence[RequestStream] = ()
) -> Any:
    """Await `coro`, cancelling it and aborting its engine requests if the client goes away."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
        close_all(streams)
