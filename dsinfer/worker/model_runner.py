"""ModelRunner: SchedulerOutput → tensors → forward over the paged cache → sampled tokens.

It never sees a Request: what it must remember between steps (sampling params, generators, the
tokens it sampled) arrives once as NewRequestData and is dropped on finished_req_ids.
"""

from __future__ import annotations

import logging

import torch

from dsinfer.config import CacheConfig, EngineConfig, context_length
from dsinfer.device.graphs import graphs_unavailable
from dsinfer.device.host_memory import gather, huge_pages_mode, release_freed_memory
from dsinfer.distributed.parallel_state import parallel_state
from dsinfer.layers.backend import apply_backend
from dsinfer.models.loader import LoadedModel
from dsinfer.structured import GrammarCompiler
from dsinfer.worker.decode_graphs import DecodeGraphs, graph_unsafe
from dsinfer.worker.grammar_mask import BitmaskFiller, GrammarState, apply_bitmask, keep_mask
from dsinfer.worker.input_batch import ModelInput, build_model_input
from dsinfer.worker.kv_cache import allocate_kv_cache
from dsinfer.worker.ngram_drafter import NgramDrafter
from dsinfer.worker.prediction_drafter import PredictionDrafter
from dsinfer.worker.sampler import Sampler, SamplerState, prompt_logprob_entries
from dsinfer.worker.spec_decode import MTPDrafter, draft_rows, sample_rows, verify_drafts
from dsinfer.worker.step_io import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        cache: CacheConfig,
        device: torch.device,
        seed: int = 0,
        speculative: bool = True,
        driver: bool = True,
        backend: str = "reference",
        step_program: bool = False,
        int8_activations: str = "none",
        max_num_seqs: int = 64,
        decode_graphs: bool | None = None,
        ngram_speculation: int = 0,
        huge_pages: bool = True,
        max_model_len: int | None = None,
        mtp_drafts: int = 1,
    ) -> None:
        """step_program: capture the decode step (fused backend): one C++ program on the CPU,
        graphs per batch bucket on an accelerator. decode_graphs: None decides by the device
        (graphs where it records them); True records with any backend, on the CPU with eager
        graphs (how their padding is tested here); False never. huge_pages: on the CPU, the
        weights and the KV pool live in transparent huge pages (device/host_memory.py).
        max_model_len: the context length asked for (None: the model's), which sizes the auto
        KV budget. mtp_drafts: draft tokens a step from a DeepSeek-V3 MTP layer (a chain)."""
        # The driver (rank 0) samples and keeps results; the other ranks run the same calls in
        # the same order (their parts of the collectives) and keep nothing.
        self.driver = driver
        self.model = loaded.model
        self.backend = apply_backend(self.model, backend, device, int8_activations).name
        huge_pages = huge_pages and device.type == "cpu"
        if huge_pages:
            # After the backend's repacking (the layouts its kernels read), before anything
            # binds the weights' addresses (the step program, graphs).
            self._gather_weights()
        # The backend's post-load preparation (the VNNI repacking) and the gathering freed the
        # weights' earlier copies: return those pages before the KV pool is allocated (−32 MiB
        # resident for SmolLM2 once serving, measured; the pool would reuse only part of them).
        release_freed_memory()
        self.config = loaded.config
        self.dtype = loaded.dtype
        self.device = device
        self.block_size = cache.block_size
        graphs = self._graphs_wanted(step_program, decode_graphs)
        pool = allocate_kv_cache(
            loaded.config,
            cache,
            loaded.dtype,
            device,
            context_length(loaded.config, max_model_len),
            reserved_blocks=1 if graphs else 0,
            huge_pages=huge_pages,
        )
        self.kv_caches, self.num_blocks, self.kv_budget = pool.caches, pool.num_blocks, pool.budget
        self.graphs: DecodeGraphs | None = None
        if graphs:
            self._capture_graphs(max_num_seqs)
        else:
            self._capture_step_program(step_program and device.type == "cpu")
        self.sampler = Sampler()
        self.states: dict[str, SamplerState] = {}
        self.drafter = self._drafter(speculative, ngram_speculation, mtp_drafts)
        # Requests that carry a predicted output draft from it instead (prediction_drafter.py).
        self.predictions = PredictionDrafter(lambda rid: self.states[rid].output_token_ids)
        # Constrained decoding: the engine hands its compiler over (use_grammars); bitmasks
        # are filled on a helper thread during the forward pass.
        self.grammars: GrammarCompiler | None = None
        self._bitmasks = BitmaskFiller(loaded.config.vocab_size)
        self._json_keep: torch.Tensor | None = None  # built on the first JSON request
        # Unseeded requests draw their generator seeds from this stream: runs are reproducible.
        self._seed_stream = torch.Generator().manual_seed(seed)

    @classmethod
    def for_engine(
        cls, loaded: LoadedModel, config: EngineConfig, device: torch.device, driver: bool = True
    ) -> ModelRunner:
        """The runner an engine config asks for (an EngineConfig: cache, seed, MTP, backend,
        step program); every executor and rank builds it the same way."""
        return cls(
            loaded,
            config.cache,
            device,
            config.seed,
            config.mtp,
            driver=driver,
            backend=config.backend,
            step_program=config.step_program,
            int8_activations=config.int8_activations,
            max_num_seqs=config.scheduler.max_num_seqs,
            ngram_speculation=config.ngram_speculation,
            huge_pages=config.huge_pages,
            max_model_len=config.scheduler.max_model_len,
            mtp_drafts=config.mtp_drafts,
        )

    def _gather_weights(self) -> None:
        """Every parameter and buffer, in the order the model registers (and runs) them, copied
        into one huge-page arena: a decode step streams them as one run of memory."""
        arena = gather([*self.model.parameters(), *self.model.buffers()])
        if arena is not None:
            logger.info(
                "weights: %.1f MiB in one arena (transparent huge pages: %s)",
                arena.nbytes / 2**20,
                huge_pages_mode() if arena.advised else "not advised",
            )

    @property
    def step_program(self) -> bool:
        """Whether decode-only steps run captured: the model's C++ program or step graphs."""
        return getattr(self.model, "step_program", None) is not None or self.graphs is not None

    def _graphs_wanted(self, step_program: bool, decode_graphs: bool | None) -> bool:
        """Whether decode steps are recorded as graphs; logs why not where they were wanted."""
        if decode_graphs is None:  # the fused step of a device that records graphs (the
            # CPU's fused step is the C++ program)
            decode_graphs = (
                step_program and self.backend == "fused" and graphs_unavailable(self.device) is None
            )
        if not decode_graphs:
            return False
        state = parallel_state()
        why = (
            "tensor or pipeline parallel ranks"
            if state.tp_size > 1 or state.pp_size > 1
            else graph_unsafe(self.model)
        )
        if why:
            logger.info("decode steps run uncaptured: %s", why)
            return False
        return True

    def _capture_graphs(self, max_num_seqs: int) -> None:
        """Decode steps as graphs per (batch, context) bucket, recorded on first use; their
        padding rows write into the block reserved after the scheduler's."""
        max_len = self.config.max_position_embeddings
        model, caches = self.model, self.kv_caches  # not self: the graphs keep this function
        self.graphs = DecodeGraphs(
            lambda ids, pos, meta: model(ids, pos, caches, meta),
            pad_block=self.num_blocks,
            block_size=self.block_size,
            max_batch=max_num_seqs,
            max_blocks=min(self.num_blocks, -(-max_len // self.block_size)),
            device=self.device,
        )
        logger.info("decode steps replay graphs per batch bucket (worker/decode_graphs.py)")

    def _capture_step_program(self, wanted: bool) -> None:
        """Capture the decode step as one program (fused backend, a model that can) once the
        KV pool is bound; logs whether decode steps run captured or layer by layer."""
        capture = getattr(self.model, "capture_step_program", None)
        if not wanted or self.backend != "fused" or capture is None:
            return
        if why_not := capture(self.kv_caches):
            logger.info("decode steps run layer by layer: %s", why_not)
        else:
            logger.info("decode steps run as one captured program (layers/step_program.py)")

    def _drafter(
        self, mtp: bool, ngram: int, mtp_drafts: int = 1
    ) -> MTPDrafter | NgramDrafter | None:
        """Speculative decoding: prompt lookup when asked for (ngram draft tokens a step), else
        the model's MTP layer (a chain of mtp_drafts) when it has one and `mtp` is on, else
        none."""
        if ngram:
            logger.info("speculative decoding: prompt lookup, up to %d draft tokens a step", ngram)
            return NgramDrafter(ngram, self._history)
        if mtp and getattr(self.model, "mtp", None) is not None:
            if mtp_drafts > 1:
                logger.info(
                    "speculative decoding: MTP, a chain of %d draft tokens a step", mtp_drafts
                )
            return MTPDrafter(self.model, self.kv_caches, mtp_drafts, self.block_size)
        return None

    def _history(self, req_id: str) -> list[int]:
        """A request's tokens so far: its prompt, then what it generated."""
        st = self.states[req_id]
        return st.prompt_token_ids + st.output_token_ids

    def _new_generator(self, seed: int | None) -> torch.Generator:
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_stream))
        return torch.Generator(device=self.device).manual_seed(seed)

    def use_grammars(self, compiler: GrammarCompiler) -> None:
        """Compile (or find cached) the grammars of constrained requests with `compiler`."""
        self.grammars = compiler

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step. On failure the sampler states (tokens, grammar positions) are rolled back
        to where they were, so the engine may retry the step (or parts of it) without a token
        counted twice."""
        marks = {
            s.req_id: (len(st.output_token_ids), st.grammar.num_accepted if st.grammar else 0)
            for s in out.seqs
            if (st := self.states.get(s.req_id))
        }
        try:
            return self._execute(out)
        except BaseException:
            for rid, (n, n_grammar) in marks.items():
                if (st := self.states.get(rid)) is not None:
                    del st.output_token_ids[n:]
                    if st.grammar is not None:
                        st.grammar.rollback_to(n_grammar)
            raise

    def _new_state(self, params, prompt_token_ids: list[int]) -> SamplerState:  # noqa: ANN001
        grammar = None
        if params.structured is not None and self.driver:
            if self.grammars is None:
                raise ValueError("this engine was built without a grammar compiler")
            spec = params.structured
            keep = None
            if spec.kind in ("json", "json_object"):
                if self._json_keep is None:
                    banned = self.grammars.control_tokens()
                    self._json_keep = keep_mask(banned, self.config.vocab_size)
                keep = self._json_keep
            grammar = GrammarState(self.grammars.new_matcher(spec), keep)
        return SamplerState(params, prompt_token_ids, self._new_generator(params.seed), [], grammar)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            self.states.pop(rid, None)
            self.predictions.forget(rid)
            if self.drafter is not None:
                self.drafter.forget(rid)
        for nr in out.new_requests:
            self.states[nr.req_id] = self._new_state(nr.params, nr.prompt_token_ids)
            if nr.prediction_token_ids:
                self.predictions.start(nr.req_id, nr.prediction_token_ids)
        result = ModelRunnerOutput()
        if not out.seqs:
            return result
        inp = build_model_input(out.seqs, self.block_size, self.device)
        sample_idx, rows = self._sample_rows(inp)
        states = [self.states[inp.seqs[i].req_id] for i in sample_idx] if self.driver else []
        masks = self._bitmasks.start([st.grammar for st in states])  # fills during the forward
        hidden = self._forward(inp)  # [T, hidden]
        if getattr(self.model, "lm_head", None) is None:
            return result  # a later pipeline stage: its part ended with the send
        # From here every rank of the stage runs the same calls in the same order (a split
        # vocabulary makes each logits call a collective, the MTP layer is split like the
        # model); only the driver samples and keeps results.
        if sample_idx:
            spec, check = draft_rows(inp, {inp.seqs[i].req_id for i in sample_idx})
            if check:  # the rows that verify drafts: one LM head pass with the sampling rows
                rows = torch.cat([rows, torch.tensor(check, device=rows.device)])
            all_logits = self._logits(hidden[rows])  # [B + C, V] fp32 on the driver
            if all_logits is not None:
                logits = all_logits[: len(sample_idx)]  # [B, V]
                if masks is not None:
                    apply_bitmask(logits, masks.result())  # before logprobs and sampling
                self._sample(inp, sample_idx, states, logits, result)
                if check:
                    verify_drafts(
                        all_logits[len(sample_idx) :], spec, result, self.states, self.sampler
                    )
                    for rid, extra in result.bonus.items():
                        self.states[rid].output_token_ids.extend(extra)
        # Any request may be drafted for: verification is exact whatever it asks of the sampler
        # (spec_decode.py), and a stop string inside a verified run ends the output where a
        # token-a-step decode ends it (LLMEngine._process).
        predicted = self.predictions.req_ids
        if self.drafter is not None:
            wants = {s.req_id for s in inp.seqs} - predicted
            self.drafter.propose(inp, hidden, result, wants, self.driver)
        if predicted:
            self.predictions.propose(inp, hidden, result, predicted, self.driver)
        self._prompt_logprobs(inp, hidden, result)
        return result if self.driver else ModelRunnerOutput()

    def _forward(self, inp: ModelInput) -> torch.Tensor:
        """The model's pass: a recorded graph for a decode-only step that fits one."""
        g = self.graphs
        if g is not None and g.takes(inp.input_ids.shape[0], inp.meta):
            return g.run(inp.input_ids, inp.positions, inp.meta)
        return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)

    def _logits(self, hidden_rows: torch.Tensor) -> torch.Tensor | None:
        """Logits of some rows on the driver; on another rank, its part of the collective when
        the vocabulary is split (nothing otherwise). Every rank calls this in the same order."""
        if self.driver:
            return self.model.compute_logits(hidden_rows)
        if self.model.lm_head.parallel == "column":
            self.model.compute_logits(hidden_rows)
        return None

    def _sample(self, inp, sample_idx, states, logits, result: ModelRunnerOutput) -> None:  # noqa: ANN001
        tokens, lps = self.sampler(logits, states)
        for i, tok, lp, st in zip(sample_idx, tokens, lps, states, strict=True):
            rid = inp.seqs[i].req_id
            result.sampled[rid] = tok
            st.output_token_ids.append(tok)
            if st.grammar is not None:
                st.grammar.accept(tok)
            if lp is not None:
                result.logprobs[rid] = [lp]

    def _sample_rows(self, inp) -> tuple[list[int], torch.Tensor | None]:  # noqa: ANN001
        """Which sequences sample this step, and the hidden-state row of each."""
        sample_idx = [i for i, s in enumerate(inp.seqs) if s.do_sample]
        if not sample_idx:
            return sample_idx, None
        row_of = sample_rows(inp)
        return sample_idx, torch.tensor([row_of[i] for i in sample_idx], device=self.device)

    def _prompt_rows(self, inp) -> list[tuple[int, int, int]]:  # noqa: ANN001
        """(sequence index, first row, rows) whose prompt logprobs this chunk yields: row r
        holds position start_pos + r and predicts prompt[pos + 1]."""
        spans = []
        for i, s in enumerate(inp.seqs):
            if not s.want_prompt_logprobs:
                continue
            prompt = self.states[s.req_id].prompt_token_ids
            n = min(len(s.token_ids), len(prompt) - 1 - s.start_pos)
            if n > 0:
                spans.append((i, inp.last_rows[i] - len(s.token_ids) + 1, n))
        return spans

    def _prompt_logprobs(self, inp, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:  # noqa: ANN001
        """Logprob of each prompt token given its prefix, for rows inside this chunk."""
        for i, first_row, n in self._prompt_rows(inp):
            s = inp.seqs[i]
            st = self.states[s.req_id]
            logits = self._logits(hidden[first_row : first_row + n])
            if logits is None:
                continue  # another rank: its part of the collective is done
            targets = st.prompt_token_ids[s.start_pos + 1 : s.start_pos + 1 + n]
            entries = prompt_logprob_entries(logits, targets, st.params.prompt_logprobs or 0)
            result.prompt_logprobs[s.req_id] = [
                (s.start_pos + 1 + j, e) for j, e in enumerate(entries)
            ]
