"""A request's life in the control plane: its tokens, progress and finish state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from dsinfer.sampling import SamplingParams, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed inside the engine; the others in its step went on

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    # Self-speculative decoding: drafts for the next step, and how many were checked/accepted.
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # The predicted output's tokens (SamplingParams.prediction), drafted from by the worker.
    prediction_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_tokens(self) -> int:
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.params.max_tokens
        return room if mt is None else min(mt, room)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def drop_last_tokens(self, n: int) -> None:
        """Take back the last n output tokens (and their logprobs) of a request that is
        finishing: a stop string ended its text before them."""
        if n > 0:
            del self.output_token_ids[-n:]
            del self.all_token_ids[-n:]
            del self.logprobs[len(self.output_token_ids) :]

    def check_stop_token(self) -> RequestStatus | None:
        """Token-level finish rules (stop strings are checked on text, by the detokenizer)."""
        n_out = len(self.output_token_ids)
        if n_out == 0:
            return None
        last = self.output_token_ids[-1]
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in self.params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
