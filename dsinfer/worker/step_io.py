"""The two records that cross the engine/worker boundary: SchedulerOutput down, ModelRunnerOutput up.

They live on the worker side so that imports flow one way (engine → worker); they carry plain
Python data only, so the scheduler is tested without tensors and the runner never sees a Request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsinfer.sampling import SamplingParams, TokenLogprobs


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """Sent once, the first time a request is scheduled: what the sampler must remember."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # The predicted output's tokens (SamplingParams.prediction), or none.
    prediction_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request's slice of a step: compute `token_ids` at positions start_pos.. ."""

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    do_sample: bool
    want_prompt_logprobs: bool = False
    prompt_len: int = 0
    # Speculative decoding: the last `num_draft` of token_ids are drafts to verify.
    num_draft: int = 0
    # The known token after this slice (a prompt chunk that is not the last): the MTP layer
    # needs token i+1 at position i.
    next_token_id: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    # Tokens after `sampled` that verified drafts let this step emit too.
    bonus: dict[str, list[int]] = field(default_factory=dict)
    # Draft tokens proposed for each request's next step (MTP, prompt lookup, a prediction).
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # Where asked: one entry for `sampled`, then one for each token of `bonus`.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> [(position of the predicted prompt token, its logprobs)]
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)
