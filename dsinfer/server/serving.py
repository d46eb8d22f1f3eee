"""Turning OpenAI requests into engine requests and engine outputs into OpenAI responses."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dsinfer.engine.outputs import RequestOutput
from dsinfer.sampling import SamplingParams, TokenLogprobs, check_token_ids
from dsinfer.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRestartingError,
    RequestFailedError,
)
from dsinfer.server.errors import APIError
from dsinfer.server.metrics import ServerMetrics, labels_of
from dsinfer.structured import GrammarCompiler, StructuredOutputs, compiler_for
from dsinfer.tokenizer import Tokenizer


@dataclass
class ServedModel:
    name: str
    engine: AsyncEngine
    tokenizer: Tokenizer
    max_model_len: int
    version: str | None = None
    reasoning: bool = False  # R1-style: split <think>…</think> into reasoning_content
    created: int = field(default_factory=lambda: int(time.time()))
    # The engine's grammar compiler (its cache is the engine's); built from the tokenizer
    # when not given.
    grammars: GrammarCompiler | None = None

    async def prepare_constraint(self, body: Any) -> None:
        """Compile the request's grammar on a worker thread, before admission, so that the
        event loop never waits on a compile; 400 naming the field for a bad constraint."""
        spec, param = self._asked(body)
        if spec is not None:
            await asyncio.to_thread(self._compile, spec, param)

    def constraint(self, body: Any) -> StructuredOutputs | None:
        """The request's output constraint (its grammar is in the cache by now)."""
        spec, param = self._asked(body)
        if spec is not None:
            self._compile(spec, param)
        return spec

    def _asked(self, body: Any) -> tuple[StructuredOutputs | None, str | None]:
        try:
            return body.structured()
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def _compile(self, spec: StructuredOutputs, param: str | None) -> None:
        if self.grammars is None:
            self.grammars = compiler_for(self.tokenizer, self.tokenizer.vocab_size)
        try:
            self.grammars.compile(spec)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param, code="unsupported_schema") from None

    def with_prediction_ids(self, params: SamplingParams) -> SamplingParams:
        """params with its prediction text as token ids: encoded here, once a request (its n
        samples share them), as far as max_tokens tokens reach (Tokenizer.encode_prefix), so
        the engine's thread never encodes a long prediction."""
        if not isinstance(params.prediction, str) or params.max_tokens is None:
            return params
        ids = self.tokenizer.encode_prefix(params.prediction, params.max_tokens)
        return dataclasses.replace(params, prediction=ids)

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


request_log = logging.getLogger("dsinfer.requests")


class Timing:
    """One request's latencies for the metrics histograms, and its record in the request log
    when it ends (`--log-format json`: one JSON line; prompt text only with `--log-prompts`)."""

    def __init__(
        self,
        metrics: ServerMetrics,
        served: ServedModel,
        request: Any = None,
        response_id: str = "",
        prompt_tokens: int = 0,
        prompt: str | None = None,
    ) -> None:
        self.metrics, self.labels, self.model = metrics, labels_of(served), served.name
        state = getattr(request, "state", None)
        self.request_id = getattr(state, "request_id", "") if state is not None else ""
        app_state = getattr(getattr(request, "app", None), "state", None)
        self.prompt = prompt if getattr(app_state, "log_prompts", False) else None
        self.response_id, self.prompt_tokens = response_id, prompt_tokens
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        # The per-token series, looked up once: `labels()` costs more than the observation.
        self._itl = metrics.itl.labels(*self.labels)
        self._generated = metrics.generation_tokens.labels(*self.labels)

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.first = now - self.start
            self.metrics.ttft.labels(*self.labels).observe(self.first)
        else:
            self._itl.observe((now - self.last) / n)
        self.last = now
        self._generated.inc(n)

    def done(self, choices: Sequence[ChoiceState] = ()) -> None:
        """The request ended: its latency, each choice's finish reason, its log record."""
        e2e = time.perf_counter() - self.start
        self.metrics.e2e.labels(*self.labels).observe(e2e)
        reasons = [c.finish_reason or "abort" for c in choices]
        for reason in reasons:
            self.metrics.request_success.labels(*self.labels, reason).inc()
        record = {
            "request_id": self.request_id,
            "id": self.response_id,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": sum(len(c.token_ids) for c in choices),
            "ttft_s": None if self.first is None else round(self.first, 4),
            "e2e_s": round(e2e, 4),
            "finish_reason": reasons[0] if len(set(reasons)) == 1 else reasons,
        }
        if self.prompt is not None:
            record["prompt"] = self.prompt
        request_log.info(
            "%s %s prompt=%d out=%d ttft=%s e2e=%.3fs finish=%s",
            self.request_id or "-",
            self.model,
            record["prompt_tokens"],
            record["completion_tokens"],
            "-" if self.first is None else f"{self.first:.3f}s",
            e2e,
            record["finish_reason"],
            extra={"record": record},
        )


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
    """SSE chunk writer for one streamed response (`kind`: the OpenAI `object` value); every
    chunk carries the request's creation time, as OpenAI's do."""
    created = int(time.time())

    def chunk(choices: list[dict], usage_: dict | None = None) -> str:
        obj = {
            "id": rid,
            "object": kind,
            "created": created,
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


def check_token_fields(served: ServedModel, body: Any) -> None:
    """Token ids in logit_bias and stop_token_ids must be in the model's vocabulary."""
    vocab = served.tokenizer.vocab_size
    for name, ids in (
        ("logit_bias", [int(k) for k in body.logit_bias or {}]),
        ("stop_token_ids", body.stop_token_ids or []),
    ):
        try:
            check_token_ids(ids, vocab)
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None


def as_api_error(exc: BaseException) -> BaseException:
    """The HTTP answer for what a handler or the engine raised; other exceptions unchanged
    (the app's last handler makes them a 500 and logs them)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestFailedError) and exc.client_error:
        return APIError(400, str(exc), code="unsatisfiable_constraint")
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
