"""Batched sampling with per-request state: penalties, temperature, top-k/p, min-p, seeds.

Each request owns a torch.Generator seeded from its `seed` (or from the engine's seed stream),
and its random draws never depend on other rows, so the same seed gives the same text whatever
else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsinfer.sampling import SamplingParams, TokenLogprobs
from dsinfer.worker.grammar_mask import GrammarState
from dsinfer.worker.token_draw import draw_sampled, filter_rows, greedy_tokens


@dataclass
class SamplerState:
    params: SamplingParams
    prompt_token_ids: list[int]
    generator: torch.Generator
    output_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None  # constrained decoding (structured outputs)


def apply_penalties(logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
    """Repetition (prompt + output, multiplicative) and OpenAI frequency/presence (output only)."""
    for i, st in enumerate(states):
        p = st.params
        if not p.needs_penalties:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(st.prompt_token_ids + st.output_token_ids)),
                dtype=torch.int64,
                device=row.device,
            )
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
        if st.output_token_ids and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(
                torch.tensor(st.output_token_ids, dtype=torch.int64, device=row.device),
                minlength=row.shape[0],
            )[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
    """Add each request's logit_bias to its row (ids past the vocabulary are refused earlier)."""
    for i, st in enumerate(states):
        bias = st.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
            vals = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, vals)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """filter_rows for one row [V]."""
    return filter_rows(logits.unsqueeze(0), [params])[0]


def _logprob_entry(lp_row: torch.Tensor, token: int, top_n: int) -> TokenLogprobs:
    chosen = float(lp_row[token])
    rank = int((lp_row > lp_row[token]).sum()) + 1
    top: list[tuple[int, float]] = []
    if top_n:
        vals, idx = torch.topk(lp_row, top_n)
        # Tokens a grammar or a -100 bias removed (-inf) are not alternatives: leave them out.
        top = [
            (int(i), float(v))
            for i, v in zip(idx.tolist(), vals.tolist(), strict=True)
            if v != float("-inf")
        ]
    return TokenLogprobs(token, chosen, rank, top)


class Sampler:
    def __call__(
        self, logits: torch.Tensor, states: list[SamplerState]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: fp32 [B, V] → one token per row, plus logprobs where asked. Constrained
        rows arrive masked already (-inf: worker/grammar_mask.py)."""
        if any(st.params.logit_bias for st in states):
            logits = apply_logit_bias(logits.clone(), states)
        want_lp = [st.params.logprobs is not None for st in states]
        raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        if any(st.params.needs_penalties for st in states):
            logits = apply_penalties(logits.clone(), states)
        drawn = [i for i, st in enumerate(states) if not st.params.greedy]
        greedy = [i for i, st in enumerate(states) if st.params.greedy]
        tokens = [0] * len(states)
        if greedy:
            rows = logits[greedy] if len(greedy) < len(states) else logits
            for i, token in zip(greedy, greedy_tokens(rows), strict=True):
                tokens[i] = token
        if drawn:
            rows = logits[drawn] if len(drawn) < len(states) else logits
            picks = draw_sampled(
                rows, [states[i].params for i in drawn], [states[i].generator for i in drawn]
            )
            for i, token in zip(drawn, picks, strict=True):
                tokens[i] = token
        lps: list[TokenLogprobs | None] = []
        for i, st in enumerate(states):
            if raw_lp is None or st.params.logprobs is None:
                lps.append(None)
            else:
                lps.append(_logprob_entry(raw_lp[i], tokens[i], st.params.logprobs))
        return tokens, lps


def prompt_logprob_entries(
    logits: torch.Tensor, targets: list[int], top_n: int
) -> list[TokenLogprobs]:
    """logits [N, V] at positions p predicting targets[p] → one entry each."""
    lp = torch.log_softmax(logits, dim=-1)
    return [_logprob_entry(lp[i], t, top_n) for i, t in enumerate(targets)]
