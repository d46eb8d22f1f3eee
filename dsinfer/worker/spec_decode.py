"""Self-speculative decoding on the worker: verify drafts by sampling, propose the next ones.

A step may carry, for a decode, draft tokens after the real last token: [t_n, d_{n+1}, …]. The
main model runs them as one small chunk, so it yields logits at every position in one pass.
Rejected positions need no KV rollback: the scheduler counts only verified positions as
computed, and the next step overwrites the rest.

Verification is exact for greedy and sampled requests alike. Every drafter here proposes one
token per position, not a distribution (a point mass q), and for such a draft speculative
sampling's rule (accept d with probability min(1, p(d)/q(d)) = p(d), else draw from p without
d) is the same as: draw the token from the row's own distribution p, exactly as a plain step
would, and keep going while the drawn token equals the draft. So each row after the sampled one
is drawn by the request's sampler (penalties over the tokens before it, logit bias,
temperature, top-k/p, min-p, its grammar), and the draft at that position decides only whether
the next row is read at all. Each row drawn consumes one number of the request's generator,
in order, as a plain step does; rows drawn but not emitted are given back (the generator is
rewound): a seed gives the text plain decoding gives, wherever the logits agree bit for bit.

The MTP drafter runs the model's multi-token-prediction layer over the same rows and attention
metadata as the main pass (its own KV layer), each row fed with the token that follows it, and
reads one draft at each request's last verified row. The prompt-lookup drafter
(worker/ngram_drafter.py) takes the same seam: `propose(inp, hidden, result, wants_draft,
driver)` fills result.drafts, `forget(req_id)` when a request ends.
"""

from __future__ import annotations

import dataclasses

import torch

from dsinfer.distributed.comm import share_with_stage
from dsinfer.worker.input_batch import ModelInput, build_model_input
from dsinfer.worker.sampler import Sampler, SamplerState
from dsinfer.worker.step_io import ModelRunnerOutput, ScheduledSeq
from dsinfer.worker.token_draw import skip_draws


def sample_rows(inp: ModelInput) -> list[int]:
    """Row whose logits give each sequence's next token (before its drafts)."""
    return [last - s.num_draft for s, last in zip(inp.seqs, inp.last_rows, strict=True)]


def draft_rows(inp: ModelInput, sampled: set[str] | dict) -> tuple[list, list[int]]:
    """(index, seq) of the sampled sequences that carry drafts, and the rows that check them."""
    spec = [(i, s) for i, s in enumerate(inp.seqs) if s.num_draft and s.req_id in sampled]
    rows = [inp.last_rows[i] - s.num_draft + 1 + j for i, s in spec for j in range(s.num_draft)]
    return spec, rows


def verify_drafts(
    logits: torch.Tensor,
    spec: list,
    result: ModelRunnerOutput,
    states: dict[str, SamplerState],
    sampler: Sampler,
) -> None:
    """Extend result.sampled with result.bonus (and result.logprobs with theirs): the tokens
    each row after the sampled one draws while the token before it equals the draft there.
    `spec` and the rows of `logits` [rows, V] (fp32) are draft_rows' (one row per draft);
    `states` holds each request's sampler state, whose output already ends with the sampled
    token. Constrained requests are read a row at a time (each row's mask follows the grammar
    through the tokens before it); the others in one sampler call."""
    if not spec:
        return
    k, first_row = 0, {}
    for _i, s in spec:
        first_row[s.req_id] = k
        k += s.num_draft
    # A request whose sampled token already differs from its first draft keeps none of its
    # rows: nothing of it to draw (nor a generator to rewind).
    free = [
        (i, s)
        for i, s in spec
        if states[s.req_id].grammar is None
        and result.sampled[s.req_id] == s.token_ids[-s.num_draft]
    ]
    if free:
        _verify_batched(logits, free, first_row, result, states, sampler)
    for _i, s in spec:
        if states[s.req_id].grammar is not None:
            _verify_constrained(logits, s, first_row[s.req_id], result, states[s.req_id], sampler)


def _row_state(st: SamplerState, drafts: list[int], j: int) -> SamplerState:
    """The sampler state of check row j (0-based; the row fed draft j): the output so far
    (ending with the sampled token, which equals draft 0 whenever this row counts), then
    drafts 1..j, which are the tokens drawn before this row whenever its token is kept. The
    penalties count them, as a plain step at that position would."""
    if not st.params.needs_penalties or j == 0:
        return st
    return dataclasses.replace(st, output_token_ids=st.output_token_ids + drafts[1 : j + 1])


def _emitted(last: int, drafts: list[int], drawn: list[int]) -> int:
    """How many check rows' tokens a run of drafts lets through: row j's token counts while
    the token before it (the sampled one for row 0) equals draft j."""
    n = 0
    for draft, tok in zip(drafts, drawn, strict=True):
        if last != draft:
            break
        n, last = n + 1, tok
    return n


def _verify_batched(logits, spec, first_row, result, states, sampler) -> None:  # noqa: ANN001
    """Every check row of requests without a grammar, drawn in one sampler call. A sampled
    request's rows draw from its generator in row order (row j takes the j-th number after the
    sampled token's, as plain steps would); afterwards the generator is rewound and advanced
    past the rows emitted only."""
    rows: list[int] = []
    row_states: list[SamplerState] = []
    rewind: dict[str, torch.Tensor] = {}
    for _i, s in spec:
        st = states[s.req_id]
        drafts = s.token_ids[-s.num_draft :]
        rows.extend(range(first_row[s.req_id], first_row[s.req_id] + s.num_draft))
        row_states.extend(_row_state(st, drafts, j) for j in range(s.num_draft))
        if not st.params.greedy:
            rewind[s.req_id] = st.generator.get_state()
    selected = logits if len(rows) == logits.shape[0] else logits[rows]
    tokens, lps = sampler(selected, row_states)
    r = 0
    for _i, s in spec:
        st = states[s.req_id]
        drafts = s.token_ids[-s.num_draft :]
        n = _emitted(result.sampled[s.req_id], drafts, tokens[r : r + s.num_draft])
        if s.req_id in rewind:
            st.generator.set_state(rewind[s.req_id])
            skip_draws(st.generator, n)
        if n:
            result.bonus[s.req_id] = tokens[r : r + n]
            if s.req_id in result.logprobs:
                result.logprobs[s.req_id].extend(lps[r : r + n])  # type: ignore[arg-type]
        r += s.num_draft


def _verify_constrained(logits, s, first, result, st, sampler) -> None:  # noqa: ANN001
    """The check rows of one constrained request, a row at a time: each row is masked by the
    grammar after the tokens before it, drawn, and its token accepted into the grammar."""
    drafts = s.token_ids[-s.num_draft :]
    last = result.sampled[s.req_id]
    accepted: list[int] = []
    for j, draft in enumerate(drafts):
        if last != draft or st.grammar.finished:
            break  # a rejected draft, or the grammar ended (nothing may follow its end)
        row = st.grammar.masked(logits[first + j])  # [1, V]
        (tok,), (lp,) = sampler(row, [_row_state(st, drafts, j)])
        st.grammar.accept(tok)
        accepted.append(tok)
        if lp is not None and s.req_id in result.logprobs:
            result.logprobs[s.req_id].append(lp)
        last = tok
    if accepted:
        result.bonus[s.req_id] = accepted


class MTPDrafter:
    """Draft tokens from a DeepSeek-V3 MTP layer: one per request per step, or a chain of
    `num_drafts`. The MTP layer predicts token i+2 from the main model's state at i and token
    i+1; a chained step feeds it its own (un-normed) output and the draft it just made, one
    position on (as vLLM chains a depth-1 MTP layer). A chained step writes the MTP layer's
    KV one slot past the step's last verified token, so the scheduler holds `lookahead`
    slots past a decode's rows where the pool has them (where it has not, the chain is
    shorter); the next step's rows rewrite those slots with the verified tokens."""

    def __init__(
        self, model: torch.nn.Module, kv_caches: list, num_drafts: int = 1, block_size: int = 16
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.num_drafts = num_drafts
        self.block_size = block_size

    @property
    def lookahead(self) -> int:
        """KV slots past a sampling row's last token that a chain writes."""
        return self.num_drafts - 1

    @torch.inference_mode()
    def propose(
        self,
        inp: ModelInput,
        hidden: torch.Tensor,
        result: ModelRunnerOutput,
        wants_draft: set[str],
        driver: bool = True,
    ) -> None:
        # The stage's other ranks need the driver's tokens to feed the split MTP layer.
        shared = share_with_stage((result.sampled, result.bonus) if driver else None)
        if not driver:
            result.sampled, result.bonus = shared
        next_ids = inp.input_ids.roll(-1).clone()  # row r → token r+1 (fixed up per seq below)
        draft_rows: list[int] = []
        drafted: list[ScheduledSeq] = []
        for s, last in zip(inp.seqs, inp.last_rows, strict=True):
            if s.req_id in result.sampled:
                verified = [result.sampled[s.req_id], *result.bonus.get(s.req_id, [])]
                base = last - s.num_draft  # the row that predicted verified[0]
                for j, tok in enumerate(verified):
                    next_ids[base + j] = tok
                if s.req_id in wants_draft:
                    draft_rows.append(base + len(verified) - 1)
                    drafted.append(s)
            elif s.next_token_id is not None:
                next_ids[last] = s.next_token_id
        h, state = self.model.mtp_hidden(next_ids, hidden, inp.positions, self.kv_caches, inp.meta)
        if not draft_rows:
            return
        rows = torch.tensor(draft_rows)
        tokens = self.model.compute_logits(h[rows]).argmax(dim=-1).tolist()  # [R]
        for s, tok in zip(drafted, tokens, strict=True):
            result.drafts[s.req_id] = [int(tok)]
        positions = inp.positions[rows].tolist()  # of the rows that made the first drafts
        self._chain(drafted, positions, tokens, state[rows], result)

    def _chain(
        self,
        seqs: list[ScheduledSeq],
        positions: list[int],
        tokens: list[int],
        state: torch.Tensor,
        result: ModelRunnerOutput,
    ) -> None:
        """Drafts 2..num_drafts: step k feeds draft k−1 and the previous step's state at
        position (the first draft's row) + k − 1, as a decode row of the MTP layer alone."""
        for k in range(1, self.num_drafts):
            # A chain goes on while the request's blocks hold the slot it writes.
            keep = [
                i
                for i, (s, p) in enumerate(zip(seqs, positions, strict=True))
                if p + k < len(s.block_table) * self.block_size
            ]
            if not keep:
                return
            rows = [
                ScheduledSeq(
                    seqs[i].req_id, [tokens[i]], positions[i] + k, seqs[i].block_table, False
                )
                for i in keep
            ]
            step = build_model_input(rows, self.block_size, state.device)
            h, state = self.model.mtp_hidden(
                step.input_ids, state[keep], step.positions, self.kv_caches, step.meta
            )
            tokens = self.model.compute_logits(h).argmax(dim=-1).tolist()
            seqs = [seqs[i] for i in keep]
            positions = [positions[i] for i in keep]
            for s, tok in zip(seqs, tokens, strict=True):
                result.drafts[s.req_id].append(int(tok))

    def forget(self, req_id: str) -> None:
        """Nothing kept per request."""
