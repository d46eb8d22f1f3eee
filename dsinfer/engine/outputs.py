"""What the engine returns: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsinfer.engine.fault_isolation import RequestFailure
from dsinfer.sampling import TokenLogprobs


@dataclass
class CompletionOutput:
    """One sample of a request.

    index: which of the n samples (0..n-1). text / token_ids: everything generated so far
    (the text cut before a stop string unless include_stop_str_in_output). logprobs: one
    TokenLogprobs per token (chosen token's logprob, its rank, the top-n alternatives) when
    SamplingParams.logprobs was set, else None. finish_reason: None while running, then
    "stop" (end of text, a stop string or stop token id), "length" (max_tokens or the context)
    "abort" (cancelled) or "error" (failed alone: RequestOutput.error says why).
    stop_reason: the stop string or stop token id that ended it (None for end of text).
    delta_text / delta_token_ids: what this step added (streaming)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestMetrics:
    """Times (time.monotonic()) and counts of one request: arrival, first token, finish; the
    prompt tokens served from the prefix cache; how often it was preempted; MTP drafts."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding (MTP): drafts verified and how many were right.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def draft_acceptance_rate(self) -> float | None:
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_draft_tokens / self.num_draft_tokens


@dataclass
class RequestOutput:
    """A request's result (or, streaming, its latest delta): the prompt as given and as ids,
    one CompletionOutput per sample, whether it finished, prompt_logprobs (one per prompt
    token, None for the first) when asked, metrics, and the error of a request that failed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    # Set when the engine failed this request alone (finish_reason "error"): why, with the
    # error id that the server log carries beside the traceback.
    error: RequestFailure | None = None
