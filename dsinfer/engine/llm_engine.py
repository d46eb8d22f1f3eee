"""LLMEngine: the synchronous core. `step()` is schedule → execute → update, then detokenise."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from dsinfer.artifact.source import load_model_source
from dsinfer.artifact.verify import TrustPolicy
from dsinfer.config import EngineConfig, context_length
from dsinfer.device import resolve_device
from dsinfer.device.host_memory import loading_heap
from dsinfer.engine.block_pool import BlockPool, pool_capacity_report
from dsinfer.engine.detokenizer import IncrementalDetokenizer
from dsinfer.engine.fault_isolation import RequestFailure, execute_isolating
from dsinfer.engine.kv_cache_manager import KVCacheManager
from dsinfer.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from dsinfer.engine.request import Request, RequestStatus
from dsinfer.engine.scheduler import Scheduler, StepUpdate
from dsinfer.engine.utilization import (
    Utilization,
    UtilizationMeter,
    peak_bandwidth,
    peak_flops,
    step_model,
)
from dsinfer.models.loader import EMBEDDED_MODELS, LoadedModel, resolve_model_path
from dsinfer.sampling import SamplingParams, check_token_ids, truncated_prompt
from dsinfer.structured import compiler_for
from dsinfer.tokenizer import Tokenizer, load_tokenizer
from dsinfer.worker.executor import UniprocExecutor, make_executor
from dsinfer.worker.multiproc_executor import MultiprocExecutor

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What the engine is doing now, read in one call (metrics, stats lines, admission)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    preemptions: int
    draft_tokens: int
    accepted_draft_tokens: int
    utilization: Utilization
    step_seconds: float  # totals since start: the sums behind MBU/MFU
    step_bytes: float
    step_flops: float
    peak_bandwidth: float
    peak_flops: float

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class _Tracked:
    req: Request
    prompt: str | None
    detok: IncrementalDetokenizer


def load_for_config(config: EngineConfig) -> LoadedModel:
    """The model an engine config names: an artifact (verified under the trust policy) or a
    checkpoint. Module-level, so tensor-parallel workers can be handed it by reference."""
    policy = TrustPolicy.from_options(config.trusted_keys, config.allow_unsigned)
    return load_model_source(
        config.model,
        policy,
        config.dtype,
        str(resolve_device(config.device)),
        config.random_weights,
        config.seed,
        enable_mtp=config.mtp,
        random_quant=config.random_quant,
        quantization=config.quantization,
        backend=config.backend,
    )


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        # Start-up's large storages (weights being quantised, repacked and gathered) in
        # mappings of their own, not as holes in the heap (device/host_memory.py); the heap's
        # free pages go back to the OS at the end.
        with loading_heap():
            self._start(config)

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        device = resolve_device(config.device)
        # Measured before the model loads: its buffers never add to the process's peak memory.
        bandwidth = peak_bandwidth(config.device_profile, device.type)
        # The executor loads the model on every rank (verified first, for an artifact).
        self.executor: UniprocExecutor | MultiprocExecutor = make_executor(
            config, load_for_config, device
        )
        loaded = self.executor.loaded
        self.device = self.executor.runner.device  # rank 0's, once the rank is bound
        self.model_config = loaded.config
        self.dtype = loaded.dtype
        self.version = loaded.version  # an artifact's short version hash, else None
        self.tokenizer: Tokenizer = load_tokenizer(
            _tokenizer_source(config.tokenizer)
            if config.tokenizer
            else loaded.tokenizer_path or loaded.path
        )
        if config.chat_template is not None:
            self.tokenizer.chat_template = read_chat_template(config.chat_template)
        # Structured outputs: one grammar compiler (and cache) per tokenizer, shared with the
        # server, which compiles a request's grammar before queueing it.
        self.grammars = compiler_for(self.tokenizer, loaded.config.vocab_size)
        self.executor.runner.use_grammars(self.grammars)
        self.kv_bytes_per_token = loaded.config.kv_bytes_per_token(loaded.dtype)
        logger.info("KV cache: %d bytes per token (%s)", self.kv_bytes_per_token, loaded.dtype)
        self.block_size = config.cache.block_size
        self.max_model_len = context_length(loaded.config, config.scheduler.max_model_len)
        self.pool = BlockPool(self.executor.num_blocks, config.cache.enable_prefix_caching)
        budget = self.executor.runner.kv_budget
        info, warning = pool_capacity_report(
            self.pool.num_blocks,
            self.block_size,
            self.max_model_len,
            budget.nbytes if budget else None,
        )
        logger.info("%s", info)
        if warning:
            logger.warning("%s", warning)
        self.kv_manager = KVCacheManager(self.pool, self.block_size)
        # A chained MTP drafter writes its layer's KV past a decode's rows: slots held ahead.
        lookahead = getattr(self.executor.runner.drafter, "lookahead", 0)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, lookahead)
        self.utilization = UtilizationMeter(
            step_model(self.executor.runner.model, loaded.config, self.kv_bytes_per_token),
            bandwidth,
            peak_flops(config.device_profile, loaded.dtype, device.type),
        )
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()

    # -- requests -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        check_token_ids(ids, self.model_config.vocab_size)
        return ids

    def prediction_ids(self, prediction: str | list[int], max_tokens: int) -> list[int]:
        """A prediction's first max_tokens token ids (the rest could never be drafted); the
        text is encoded only as far as those tokens reach (Tokenizer.encode_prefix)."""
        if isinstance(prediction, str):
            return self.tokenizer.encode_prefix(prediction, max_tokens)
        ids = [int(t) for t in prediction[:max_tokens]]
        try:
            check_token_ids(ids, self.model_config.vocab_size)
        except ValueError as e:
            raise ValueError(f"prediction: {e}") from None
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises ValueError for prompts the model or the pool cannot take."""
        if params.n != 1:
            raise ValueError("LLMEngine takes n=1 requests; fan out n>1 above the engine")
        ids = truncated_prompt(self.encode_prompt(prompt), params.truncate_prompt_tokens)
        if not ids:
            raise ValueError("the prompt is empty: send at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but this model's context length is "
                f"{self.max_model_len}; shorten the prompt (at least one token must be left "
                "for the answer)"
            )
        pool_tokens = self.pool.num_blocks * self.block_size
        if len(ids) + 1 > pool_tokens:
            raise ValueError(
                f"the prompt needs {len(ids) + 1} KV slots but the whole KV pool holds "
                f"{pool_tokens}; raise kv_cache_memory (--kv-cache-memory)"
            )
        if params.structured is not None:
            self.grammars.compile(params.structured)  # ValueError for a bad constraint
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(rid, ids, params, self.tokenizer.eos_token_ids, self.max_model_len)
        if params.prediction:
            req.prediction_token_ids = self.prediction_ids(params.prediction, req.max_tokens)
        self.scheduler.add_request(req)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params)
        self._tracked[rid] = _Tracked(req, prompt if isinstance(prompt, str) else None, detok)
        return rid

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._tracked.pop(request_id, None)

    def stats(self) -> EngineStats:
        s, pool, meter = self.scheduler, self.pool, self.utilization
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_blocks_used=pool.num_used,
            kv_blocks_free=pool.num_free,
            kv_blocks_total=pool.num_blocks,
            prefix_cache_hits=pool.hits,
            prefix_cache_queries=pool.queries,
            preemptions=s.num_preemptions,
            draft_tokens=s.num_draft_tokens,
            accepted_draft_tokens=s.num_accepted_draft_tokens,
            utilization=meter.snapshot(),
            step_seconds=meter.total_seconds,
            step_bytes=meter.total_bytes,
            step_flops=meter.total_flops,
            peak_bandwidth=meter.peak_bandwidth,
            peak_flops=meter.peak_flops,
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    @property
    def num_running(self) -> int:
        """Requests in the running batch (admission reads it per request: no stats snapshot)."""
        return len(self.scheduler.running)

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step. A request that makes the step fail is failed alone (its output
        has finish_reason "error"); the engine raises only for faults that are not a request's."""
        sched_out = self.scheduler.schedule()
        if not sched_out.seqs and not sched_out.finished_req_ids:
            return []
        t0 = time.perf_counter()
        result, failures = execute_isolating(
            self.executor.execute, sched_out, self.executor.is_engine_fault
        )
        self.utilization.record(
            time.perf_counter() - t0,
            [(len(s.token_ids), s.start_pos) for s in sched_out.seqs],
        )
        outputs = [self.fail_request(rid, why) for rid, why in failures.items()]
        if failures:
            kept = [s for s in sched_out.seqs if s.req_id not in failures]
            sched_out = dataclasses.replace(sched_out, seqs=kept)
        updates = self.scheduler.update(sched_out, result)
        for u in updates:
            try:
                out = self._process(u)
            except Exception as exc:  # detokenising or stop checks of this request alone
                out = self.fail_request(u.req.request_id, RequestFailure.of(exc), log=exc)
            if out is not None:
                outputs.append(out)
        return [o for o in outputs if o is not None]

    def fail_request(
        self, request_id: str, why: RequestFailure, log: BaseException | None = None
    ) -> RequestOutput | None:
        """Finish one request with finish_reason "error"; its KV blocks return to the pool."""
        if log is not None:
            logger.error("request %s failed (error id %s)", request_id, why.error_id, exc_info=log)
        tracked = self._tracked.pop(request_id, None)
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        if tracked is None:
            return None
        out = self._make_output(tracked, [], finished=True)
        out.error = why
        return out

    def _process(self, u: StepUpdate) -> RequestOutput | None:
        tracked = self._tracked.get(u.req.request_id)
        if tracked is None:
            return None
        req, detok = u.req, tracked.detok
        new_ids = u.new_token_ids
        used = detok.add_tokens(new_ids, final=u.finished)
        if used < len(new_ids):
            # A stop string ended the text inside a run of verified drafts: the output ends
            # with the token that completed it, as a token-a-step decode would have ended.
            req.drop_last_tokens(len(new_ids) - used)
            new_ids = new_ids[:used]
        finished = u.finished
        if detok.stopped_by is not None and not finished:
            req.stop_reason = detok.stopped_by
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            finished = True
        elif detok.stopped_by is not None:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, detok.stopped_by
        if finished:
            self._tracked.pop(req.request_id, None)
        if not new_ids and not finished and not req.prompt_logprobs:
            return None
        return self._make_output(tracked, new_ids, finished)

    def _make_output(self, tracked: _Tracked, new_ids: list[int], finished: bool) -> RequestOutput:
        req = tracked.req
        params = req.params
        finish = req.status.value if finished else None
        completion = CompletionOutput(
            index=0,
            text=tracked.detok.text,
            token_ids=list(req.output_token_ids),
            logprobs=list(req.logprobs) if params.logprobs is not None else None,
            finish_reason=finish,
            stop_reason=req.stop_reason if finished else None,
            delta_text=tracked.detok.take_delta(finished),
            delta_token_ids=list(new_ids),
        )
        plp = None
        if params.prompt_logprobs is not None:
            plp = [None] + [req.prompt_logprobs.get(p) for p in range(1, req.num_prompt_tokens)]
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finished_time=time.monotonic() if finished else None,
            num_cached_tokens=req.num_cached_prompt_tokens,
            num_preemptions=req.num_preemptions,
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_draft_tokens=req.num_accepted_draft_tokens,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            prompt_logprobs=plp,
            metrics=metrics,
        )

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (nothing to do for one process)."""
        self.executor.shutdown()

    def check_integrity(self) -> None:
        self.pool.check_integrity()


def read_chat_template(value: str) -> str:
    """--chat-template: a file holding the template, or the template text itself."""
    path = Path(value).expanduser()
    if "{" not in value and len(value) < 4096:
        if not path.is_file():
            raise ValueError(
                f"--chat-template {value!r}: no such file, and not a template (no '{{' in it)"
            )
        return path.read_text()
    return value


def _tokenizer_source(name: str) -> Path:
    """An embedded model's name, a tokenizer directory, or a GGUF file."""
    return resolve_model_path(name) if name in EMBEDDED_MODELS else Path(name).expanduser()
