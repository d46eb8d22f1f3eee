"""Token-budget scheduler: one loop covers prefill chunks, decode steps and prefix-cache hits.

Each step spends at most `max_num_batched_tokens` tokens over at most `max_num_seqs` sequences.
Running requests go first (oldest first); when the pool is short, the newest running request is
preempted (its blocks freed, its tokens recomputed later). Waiting requests join only when no
preemption happened this step, so a starved pool is not refilled with new work.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from dsinfer.config import SchedulerConfig
from dsinfer.engine.kv_cache_manager import KVCacheManager
from dsinfer.engine.request import Request, RequestStatus
from dsinfer.worker.step_io import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledSeq,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepUpdate:
    """What one step did to one request, for the output processor."""

    req: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, lookahead: int = 0) -> None:
        """lookahead: KV slots to hold past a decode's rows where the pool has them (a chained
        MTP drafter writes its layer's KV there: worker/spec_decode.py)."""
        self.config = config
        self.kv = kv
        self.lookahead = lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._announced: set[str] = set()
        self._finished_ids: list[str] = []
        self._orphans: list[Request] = []
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # speculative drafts verified, all requests
        self.num_accepted_draft_tokens = 0

    # -- admission --------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, req_id: str, status: RequestStatus) -> None:
        """Stop a request (abort, or a stop string found on text); frees its blocks at once."""
        req = self.requests.get(req_id)
        if req is None or req.status.finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self._release(req)

    def _release(self, req: Request) -> None:
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if req.request_id in self._announced:
            self._announced.discard(req.request_id)
            self._finished_ids.append(req.request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted = False

        i = 0
        decodes: list[int] = []  # seqs that sample this step (drafts and lookahead go there)
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            n_running = len(self.running)
            ok = self._allocate_or_preempt(req, num_new)
            preempted = preempted or len(self.running) < n_running
            if not ok:
                break
            seqs.append(self._slice(req, num_new))
            budget -= num_new
            if req.num_computed_tokens + num_new == req.num_tokens:
                decodes.append(len(seqs) - 1)  # it samples: a decode, or a last prompt chunk
            i += 1
        # Drafts (and the lookahead slots) once every running request has its own rows: from
        # the budget and the free blocks left, never by preempting a request (a draft may be
        # wrong; a request is not). Without room for the lookahead, the drafts alone.
        for j in decodes:
            req = self.requests[seqs[j].req_id]
            num_new = len(seqs[j].token_ids)
            num_draft = self._num_draft(req, num_new, budget)
            for extra in dict.fromkeys((self.lookahead, 0)):
                want = num_new + num_draft + extra
                if (num_draft or extra) and self.kv.allocate_slots(req, want):
                    seqs[j] = self._slice(req, num_new, num_draft)
                    budget -= num_draft
                    break

        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            blocks, num_cached = [], 0
            if req.num_computed_tokens == 0 and req.params.prompt_logprobs is None:
                blocks, num_cached = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, num_new, blocks):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= num_new
            if self.lookahead and num_cached + num_new == req.num_tokens:
                # Its last prompt chunk samples (and the drafter drafts) this step.
                self.kv.allocate_slots(req, num_new + self.lookahead)
            seqs.append(self._slice(req, num_new))

        new_reqs = []
        for s in seqs:
            if s.req_id not in self._announced:
                req = self.requests[s.req_id]
                self._announced.add(s.req_id)
                new_reqs.append(
                    NewRequestData(
                        s.req_id, req.prompt_token_ids, req.params, req.prediction_token_ids
                    )
                )
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(seqs=seqs, new_requests=new_reqs, finished_req_ids=finished)

    def _allocate_or_preempt(self, req: Request, num_new: int) -> bool:
        """Allocate for `req`, preempting the newest running requests until it fits.

        Returns False when `req` itself had to be preempted (or cannot fit in an empty pool)."""
        while not self.kv.allocate_slots(req, num_new):
            victim = self.running.pop()
            if victim is req and not self.running:
                # Alone and still too big: the pool cannot hold this sequence at all.
                logger.warning("request %s exceeds the KV pool; finishing it", req.request_id)
                req.status = RequestStatus.FINISHED_LENGTH
                self._release(req)
                self._orphans.append(req)
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    @staticmethod
    def _num_draft(req: Request, num_new: int, spare: int) -> int:
        """Drafts to verify with this step's `num_new` tokens when they are a plain decode: as
        many as the `spare` budget has room for and the request may still emit (the sampled
        token and each accepted draft's follower count against max_tokens)."""
        n = len(req.draft_token_ids)
        if not n or num_new != 1 or req.num_computed_tokens + 1 != req.num_tokens:
            return 0
        room = req.max_tokens - len(req.output_token_ids)
        return max(0, min(n, spare, room - 1))

    def _preempt(self, req: Request) -> None:
        req.draft_token_ids = []
        req.status = RequestStatus.PREEMPTED
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _slice(self, req: Request, num_new: int, num_draft: int = 0) -> ScheduledSeq:
        start = req.num_computed_tokens
        end = start + num_new
        want_plp = (
            req.params.prompt_logprobs is not None
            and start < req.num_prompt_tokens - 1
            and len(req.prompt_logprobs) < req.num_prompt_tokens - 1
        )
        return ScheduledSeq(
            req_id=req.request_id,
            token_ids=req.all_token_ids[start:end] + req.draft_token_ids[:num_draft],
            start_pos=start,
            block_table=list(self.kv.block_table(req)),
            do_sample=end == req.num_tokens,
            want_prompt_logprobs=want_plp,
            prompt_len=req.num_prompt_tokens,
            num_draft=num_draft,
            next_token_id=req.all_token_ids[end] if end < req.num_tokens else None,
        )

    # -- results ------------------------------------------------------------------------------
    def _append_sampled(
        self, req: Request, seq: ScheduledSeq, result: ModelRunnerOutput, now: float
    ) -> tuple[list[int], RequestStatus | None]:
        """Append the sampled token, then any tokens that verified drafts allow, stopping at the
        first finish; each token after the first means its draft was right (KV valid)."""
        tokens = [result.sampled[seq.req_id], *result.bonus.get(seq.req_id, [])]
        appended: list[int] = []
        status = None
        for tok in tokens:
            if appended:
                req.num_computed_tokens += 1  # the draft at this position was accepted
            req.append_token(tok)
            appended.append(tok)
            status = req.check_stop_token()
            if status is not None:
                break
        req.logprobs.extend(result.logprobs.get(seq.req_id, [])[: len(appended)])
        if req.first_token_time is None:
            req.first_token_time = now
        req.num_draft_tokens += seq.num_draft
        req.num_accepted_draft_tokens += len(appended) - 1
        self.num_draft_tokens += seq.num_draft
        self.num_accepted_draft_tokens += len(appended) - 1
        req.draft_token_ids = [] if status is not None else result.drafts.get(seq.req_id, [])
        return appended, status

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[StepUpdate]:
        updates: list[StepUpdate] = []
        now = time.monotonic()
        for seq in out.seqs:
            req = self.requests.get(seq.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted since it was scheduled
            req.num_computed_tokens += len(seq.token_ids) - seq.num_draft
            for pos, lp in result.prompt_logprobs.get(seq.req_id, []):
                req.prompt_logprobs.setdefault(pos, lp)
            new_tokens: list[int] = []
            status = None
            if seq.do_sample:
                if req.max_tokens <= 0:
                    status = RequestStatus.FINISHED_LENGTH
                else:
                    new_tokens, status = self._append_sampled(req, seq, result, now)
            self.kv.cache_full_blocks(req)  # after the tokens: it hashes computed blocks
            if status is not None:
                self.running.remove(req)
                req.status = status
                self._release(req)
            updates.append(StepUpdate(req, new_tokens, status is not None))
        for req in self._orphans:
            updates.append(StepUpdate(req, [], True))
        self._orphans.clear()
        return updates
