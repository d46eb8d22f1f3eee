"""Containment: an exception raised while one request is handled fails that request, not the step.

A failed step is retried in halves (bisection) until every request that fails alone is found;
the others' results from the passing halves are merged, so they continue as if nothing happened.
A retry is safe because a step is idempotent for the state it touches: KV writes go to the same
slots, the runner rolls back what it appended on failure, and the scheduler only moves on in
`update()`, after this returns. Faults that are not a request's (out of memory, a dead
tensor-parallel rank) are not bisected: the executor marks them, they propagate, and the
AsyncEngine restarts the engine.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from dsinfer.structured.spec import UnsatisfiableConstraint
from dsinfer.worker.step_io import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """Why one request was failed by the engine; `error_id` ties the client's error to the log.
    `client_error`: the request's own input made it fail (its constraint admits no text: the
    server answers 400 with the message), rather than the engine (500)."""

    error_id: str
    message: str
    client_error: bool = False

    @classmethod
    def of(cls, exc: BaseException) -> RequestFailure:
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        if isinstance(exc, UnsatisfiableConstraint):
            return cls(error_id, str(exc), client_error=True)
        return cls(error_id, f"{type(exc).__name__}: {exc}")


def _subset(out: SchedulerOutput, req_ids: set[str]) -> SchedulerOutput:
    """The part of a step that concerns `req_ids` (finished ids were flushed by the first try)."""
    return SchedulerOutput(
        seqs=[s for s in out.seqs if s.req_id in req_ids],
        new_requests=[nr for nr in out.new_requests if nr.req_id in req_ids],
        finished_req_ids=[],
    )


def _merge(into: ModelRunnerOutput, part: ModelRunnerOutput) -> None:
    into.sampled.update(part.sampled)
    into.bonus.update(part.bonus)
    into.drafts.update(part.drafts)
    into.logprobs.update(part.logprobs)
    into.prompt_logprobs.update(part.prompt_logprobs)


def execute_isolating(
    execute: Callable[[SchedulerOutput], ModelRunnerOutput],
    out: SchedulerOutput,
    is_engine_fault: Callable[[BaseException], bool],
) -> tuple[ModelRunnerOutput, dict[str, RequestFailure]]:
    """Run one step; on a request-local failure, find the failing requests by bisection.

    Returns the merged output of every request that ran and a failure per request that did not.
    Raises whatever `is_engine_fault` accepts, and any failure of a step with no sequences."""
    try:
        return execute(out), {}
    except Exception as exc:
        if is_engine_fault(exc) or not out.seqs:
            raise
        first = exc
    if len(out.seqs) == 1:
        return ModelRunnerOutput(), _failed(out, first)
    logger.warning(
        "a step of %d sequences failed (%s: %s); retrying in halves to find the request",
        len(out.seqs),
        type(first).__name__,
        first,
    )
    merged = ModelRunnerOutput()
    failures: dict[str, RequestFailure] = {}
    pending = [[s.req_id for s in out.seqs]]
    while pending:
        ids = pending.pop()
        half = len(ids) // 2
        for part in (ids[:half], ids[half:]):
            sub = _subset(out, set(part))
            try:
                _merge(merged, execute(sub))
            except Exception as exc:
                if is_engine_fault(exc):
                    raise
                if len(part) == 1:
                    failures.update(_failed(sub, exc))
                else:
                    pending.append(part)
    return merged, failures


def _failed(out: SchedulerOutput, exc: BaseException) -> dict[str, RequestFailure]:
    (seq,) = out.seqs
    failure = RequestFailure.of(exc)
    if failure.client_error:  # the request's input, not a fault: no traceback
        logger.info("request %s ended (error id %s): %s", seq.req_id, failure.error_id, exc)
        return {seq.req_id: failure}
    logger.error(
        "request %s failed inside the engine step (error id %s); the other requests go on",
        seq.req_id,
        failure.error_id,
        exc_info=exc,
    )
    return {seq.req_id: failure}
