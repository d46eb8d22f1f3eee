"""A scripted EngineCore for the server's protocol tests: no model, no tensors.

Every request "generates" the same script of token ids (the real tokenizer's encoding of a
fixed text, cycled), one token per step, so the HTTP layer — validation, streaming framing,
errors, auth, admission, disconnects — is tested in milliseconds. What it keeps of a real engine
is what the server can observe: a running batch of `max_num_seqs` (the rest wait), a pool of KV
blocks that a request holds until it ends or is aborted, the finish rules (max_tokens, end of
text, stop strings through the real detokeniser) and logprobs in the real output types. The
end-to-end tests that need real tokens run on the real model (tests/server/conftest.py).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch

from dsinfer.engine.detokenizer import IncrementalDetokenizer
from dsinfer.engine.llm_engine import EngineStats
from dsinfer.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from dsinfer.engine.utilization import Utilization
from dsinfer.sampling import SamplingParams, TokenLogprobs, check_token_ids
from dsinfer.tokenizer import Tokenizer

SCRIPT = (
    "Once upon a time there was a small engine that answered every request it was given, "
    "one token at a time, and never fell over. "
)


@dataclass
class _Scripted:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    blocks: int
    arrival: float
    out_ids: list[int]
    logprobs: list[TokenLogprobs]
    first_token: float | None = None


class ScriptedEngine:
    """Implements dsinfer.engine.core.EngineCore over a script instead of a model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int = 8192,
        max_num_seqs: int = 8,
        num_blocks: int = 4096,
        block_size: int = 16,
        step_seconds: float = 0.01,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_blocks, self.block_size = num_blocks, block_size
        self.step_seconds = step_seconds  # the model time a step pretends to take
        self.device = torch.device("cpu")
        self.script = tokenizer.encode(SCRIPT)
        self.waiting: list[_Scripted] = []
        self.running: list[_Scripted] = []
        self.blocks_used = 0
        self.steps = 0
        self._ids = itertools.count()

    # -- EngineCore ------------------------------------------------------------------------------
    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_token_ids(ids, self.tokenizer.vocab_size)
        if not ids:
            raise ValueError("the prompt is empty: send at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context is shorter")
        rid = request_id or f"scripted-{next(self._ids)}"
        total = len(ids) + (params.max_tokens or self.max_model_len - len(ids))
        blocks = math.ceil(min(total, self.max_model_len) / self.block_size)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params)
        self.waiting.append(_Scripted(rid, ids, params, detok, blocks, time.monotonic(), [], []))
        return rid

    def abort_request(self, request_id: str) -> None:
        for queue in (self.waiting, self.running):
            for r in list(queue):
                if r.rid == request_id:
                    queue.remove(r)
                    if queue is self.running:
                        self.blocks_used -= r.blocks

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def step(self) -> list[RequestOutput]:
        self._admit()
        if not self.running:
            return []
        time.sleep(self.step_seconds)
        self.steps += 1
        outputs = []
        for r in list(self.running):
            token = self.script[len(r.out_ids) % len(self.script)]
            r.out_ids.append(token)
            r.first_token = r.first_token or time.monotonic()
            if r.params.logprobs is not None:
                top = [(token, -0.25)][: r.params.logprobs]
                r.logprobs.append(TokenLogprobs(token, -0.25, 1, top))
            finish = self._finish_reason(r, token)
            r.detok.add_tokens([token], final=finish is not None)
            if r.detok.stopped_by is not None:
                finish = "stop"
            if finish is not None:
                self.running.remove(r)
                self.blocks_used -= r.blocks
            outputs.append(self._output(r, token, finish))
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_blocks_used=self.blocks_used,
            kv_blocks_free=self.num_blocks - self.blocks_used,
            kv_blocks_total=self.num_blocks,
            prefix_cache_hits=0,
            prefix_cache_queries=0,
            preemptions=0,
            draft_tokens=0,
            accepted_draft_tokens=0,
            utilization=Utilization(),
            step_seconds=self.steps * self.step_seconds,
            step_bytes=0.0,
            step_flops=0.0,
            peak_bandwidth=1.0,
            peak_flops=1.0,
        )

    def check_integrity(self) -> None:
        held = sum(r.blocks for r in self.running)
        assert held == self.blocks_used, (held, self.blocks_used)

    def shutdown(self) -> None:
        """Nothing to stop."""

    # -- the script ------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if self.blocks_used + r.blocks > self.num_blocks:
                return
            self.waiting.pop(0)
            self.running.append(r)
            self.blocks_used += r.blocks

    def _finish_reason(self, r: _Scripted, token: int) -> str | None:
        p = r.params
        if len(r.out_ids) >= p.min_tokens:
            if token in p.stop_token_ids or (
                not p.ignore_eos and token in self.tokenizer.eos_token_ids
            ):
                return "stop"
        if p.max_tokens is not None and len(r.out_ids) >= p.max_tokens:
            return "length"
        if len(r.prompt_ids) + len(r.out_ids) >= self.max_model_len:
            return "length"
        return None

    def _output(self, r: _Scripted, token: int, finish: str | None) -> RequestOutput:
        done = finish is not None
        completion = CompletionOutput(
            index=0,
            text=r.detok.text,
            token_ids=list(r.out_ids),
            logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
            finish_reason=finish,
            stop_reason=r.detok.stopped_by if done else None,
            delta_text=r.detok.take_delta(done),
            delta_token_ids=[token],
        )
        plp = None
        if r.params.prompt_logprobs is not None:
            plp = [None] + [TokenLogprobs(t, -1.0, 1, []) for t in r.prompt_ids[1:]]
        metrics = RequestMetrics(r.arrival, r.first_token, time.monotonic() if done else None)
        return RequestOutput(r.rid, None, r.prompt_ids, [completion], done, plp, metrics)
