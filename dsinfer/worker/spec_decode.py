"""Self-speculative decoding on the worker: verify drafts greedily, propose the next ones.

A step may carry, for a decode, draft tokens after the real last token: [t_n, d_{n+1}, …]. The
main model runs them as one small chunk, so it yields logits at every position in one pass.
Verification is exact for plain greedy requests (the only ones the scheduler drafts for): keep
the sampled token s_{n+1}; while it equals the draft at that position, the next row's argmax is
a further token. Rejected positions need no KV rollback: the scheduler counts only verified
positions as computed, and the next step overwrites the rest.

The MTP drafter runs the model's multi-token-prediction layer over the same rows and attention
metadata as the main pass (its own KV layer), each row fed with the token that follows it, and
reads one draft at each request's last verified row. The prompt-lookup drafter
(worker/ngram_drafter.py) takes the same seam: `propose(inp, hidden, result, wants_draft,
driver)` fills result.drafts, `forget(req_id)` when a request ends.
"""

from __future__ import annotations

import torch

from dsinfer.distributed.comm import share_with_stage
from dsinfer.worker.grammar_mask import GrammarState
from dsinfer.worker.input_batch import ModelInput
from dsinfer.worker.step_io import ModelRunnerOutput


def sample_rows(inp: ModelInput) -> list[int]:
    """Row whose logits give each sequence's next token (before its drafts)."""
    return [last - s.num_draft for s, last in zip(inp.seqs, inp.last_rows, strict=True)]


def draft_rows(inp: ModelInput, sampled: set[str] | dict) -> tuple[list, list[int]]:
    """(index, seq) of the sampled sequences that carry drafts, and the rows that check them."""
    spec = [(i, s) for i, s in enumerate(inp.seqs) if s.num_draft and s.req_id in sampled]
    rows = [inp.last_rows[i] - s.num_draft + 1 + j for i, s in spec for j in range(s.num_draft)]
    return spec, rows


def verify_greedy(
    logits: torch.Tensor,
    spec: list,
    result: ModelRunnerOutput,
    grammars: dict[str, GrammarState] | None = None,
) -> None:
    """Extend result.sampled with result.bonus: tokens that accepted drafts make certain.
    `spec` and the rows of `logits` [rows, V] are draft_rows' (one row per draft). A
    constrained request's rows are checked against its grammar: each verified token is the
    argmax over the tokens the grammar allows there (and is accepted into it), so a draft the
    grammar forbids is never kept."""
    if not spec:
        return
    argmax = logits.argmax(dim=-1).tolist()
    grammars = grammars or {}
    k = 0
    for _i, s in spec:
        drafts = s.token_ids[-s.num_draft :]
        grammar = grammars.get(s.req_id)
        accepted: list[int] = []
        last = result.sampled[s.req_id]
        for j, draft in enumerate(drafts):
            if last != draft or (grammar is not None and grammar.finished):
                break  # a rejected draft, or the grammar ended (nothing may follow its end)
            next_tok = argmax[k + j] if grammar is None else grammar.greedy(logits[k + j])
            accepted.append(next_tok)
            last = next_tok
        k += s.num_draft
        if accepted:
            result.bonus[s.req_id] = accepted


class MTPDrafter:
    """One draft token per request per step from a DeepSeek-V3 MTP layer."""

    def __init__(self, model: torch.nn.Module, kv_caches: list) -> None:
        self.model = model
        self.kv_caches = kv_caches

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
        draft_reqs: list[str] = []
        for s, last in zip(inp.seqs, inp.last_rows, strict=True):
            if s.req_id in result.sampled:
                verified = [result.sampled[s.req_id], *result.bonus.get(s.req_id, [])]
                base = last - s.num_draft  # the row that predicted verified[0]
                for j, tok in enumerate(verified):
                    next_ids[base + j] = tok
                if s.req_id in wants_draft:
                    draft_rows.append(base + len(verified) - 1)
                    draft_reqs.append(s.req_id)
            elif s.next_token_id is not None:
                next_ids[last] = s.next_token_id
        h = self.model.mtp_hidden(next_ids, hidden, inp.positions, self.kv_caches, inp.meta)
        if not draft_rows:
            return
        logits = self.model.compute_logits(h[torch.tensor(draft_rows)])  # [R, V]
        for rid, tok in zip(draft_reqs, logits.argmax(dim=-1).tolist(), strict=True):
            result.drafts[rid] = [int(tok)]

    def forget(self, req_id: str) -> None:
        """Nothing kept per request."""
