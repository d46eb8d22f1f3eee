"""Sampler: support sets of top-k/top-p/min-p, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from dsinfer.sampling import SamplingParams
from dsinfer.worker.sampler import Sampler, SamplerState, apply_penalties, filter_logits


def _state(seed=0, prompt=(), out=(), **kw) -> SamplerState:
    return SamplerState(
        SamplingParams(**kw), list(prompt), torch.Generator().manual_seed(seed), list(out)
    )


LOGITS = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]))


def _support(params: SamplingParams) -> set[int]:
    x = filter_logits(LOGITS.clone(), params)
    return {i for i, v in enumerate(x.tolist()) if v != float("-inf")}


def test_support_sets():
    assert _support(SamplingParams(top_k=2)) == {0, 1}
    assert _support(SamplingParams(top_p=0.5)) == {0, 1}  # 0.40 < 0.5 ≤ 0.65
    assert _support(SamplingParams(top_p=0.39)) == {0}
    assert _support(SamplingParams(top_p=0.66)) == {0, 1, 2}
    assert _support(SamplingParams(min_p=0.3)) == {0, 1, 2}  # ≥ 0.12
    assert _support(SamplingParams(top_k=4, min_p=0.5)) == {0, 1}


def test_samples_stay_in_support_and_follow_distribution():
    sampler = Sampler()
    st = _state(seed=3, temperature=1.0, top_k=3)
    counts = torch.zeros(6)
    for _ in range(3000):
        tok, _ = sampler(LOGITS.clone().unsqueeze(0), [st])
        counts[tok[0]] += 1
    assert counts[3:].sum() == 0
    freq = counts[:3] / counts.sum()
    want = torch.tensor([0.40, 0.25, 0.15]) / 0.80
    assert (freq - want).abs().max() < 0.04


def test_same_seed_same_tokens_whatever_the_batch():
    sampler = Sampler()
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 50, generator=g)
    alone = [
        sampler(rows[:1].clone(), [st])[0][0]
        for st in [_state(seed=42, temperature=0.9)]
        for _ in range(1)
    ]
    seq_alone, seq_batch = [], []
    a, b = _state(seed=42, temperature=0.9), _state(seed=42, temperature=0.9)
    others = [_state(seed=s, temperature=1.0, top_p=0.8) for s in (1, 2, 3)]
    for _ in range(20):
        seq_alone.append(sampler(rows[:1].clone(), [a])[0][0])
        seq_batch.append(sampler(rows.clone(), [b, *others])[0][0])
    assert seq_alone == seq_batch
    assert alone[0] == seq_alone[0]
    c = _state(seed=43, temperature=0.9)
    assert [sampler(rows[:1].clone(), [c])[0][0] for _ in range(20)] != seq_alone


def test_greedy_is_argmax_and_ignores_generator():
    tok, _ = Sampler()(LOGITS.clone().unsqueeze(0), [_state(temperature=0)])
    assert tok == [0]


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_penalties(logits.clone(), [_state(prompt=[0], out=[1], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_frequency_and_presence_penalties():
    logits = torch.zeros(1, 4)
    st = _state(prompt=[3], out=[1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [st])
    assert out.tolist() == [[0.0, -1.25, -0.75, 0.0]]  # prompt tokens are not penalised


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    tok, _ = Sampler()(logits, [_state(temperature=0, out=[0], presence_penalty=0.5)])
    assert tok == [1]


def test_logprobs_top_n_and_rank():
    st = _state(temperature=0, logprobs=3)
    tok, lps = Sampler()(LOGITS.clone().unsqueeze(0), [st])
    lp = lps[0]
    assert lp.token_id == 0 and lp.rank == 1
    assert math.isclose(lp.logprob, math.log(0.40), rel_tol=1e-5)
    assert [t for t, _ in lp.top] == [0, 1, 2]


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=0),
        dict(max_tokens=-1),
        dict(logprobs=21),
        dict(n=0),
        dict(min_p=1.5),
        dict(presence_penalty=3),
        dict(min_tokens=5, max_tokens=3),  # it was quietly cut to 3
    ],
)
def test_invalid_params_name_the_field(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


# -- the batched draw (worker/token_draw.py) against filter_rows' distribution ------------------


@pytest.fixture(params=["kernel", "torch"])
def candidates_path(request, monkeypatch):
    """The draws below run with the C++ candidate op (the fused backend has it loaded) and with
    the torch ops that stand in for it elsewhere."""
    from dsinfer.layers.kernels.cpu_build import load_cpu_ops
    from dsinfer.worker import token_draw

    if request.param == "kernel":
        assert load_cpu_ops() is None
        assert token_draw._cpu_ops(torch.zeros(1, 2), "softmax_top_candidates")
        assert token_draw._cpu_ops(torch.zeros(1, 2), "sample_full_rows")
        assert token_draw._cpu_ops(torch.zeros(1, 2), "draw_candidates")
    else:
        monkeypatch.setattr(token_draw, "_cpu_ops", lambda logits, op: False)
    return request.param


def test_candidate_op_is_softmax_then_topk():
    """softmax_top_candidates against torch's division, softmax and top-k: rows of a large
    vocabulary, a vocabulary that is not a multiple of 16, n up to the whole row, rows with
    removed (-inf) tokens, and rows without a distribution (NaN, all -inf)."""
    from dsinfer.layers.kernels.cpu_build import load_cpu_ops

    assert load_cpu_ops() is None
    g = torch.Generator().manual_seed(0)
    for vocab, rows, n in [(49152, 4, 256), (49152, 2, 4096), (600, 5, 256), (37, 3, 37)]:
        ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
        x = torch.stack(
            [(-1.2 * ranks.log())[torch.randperm(vocab, generator=g)] * 6 for _ in range(rows)]
        )
        x += torch.randn(x.shape, generator=g)
        x[0, ::3] = float("-inf")  # a grammar's mask
        t = torch.rand(rows, generator=g) + 0.4
        probs, ids = torch.ops.dsinfer.softmax_top_candidates(x, t, n)
        want_p, want_ids = torch.topk(torch.softmax(x / t[:, None], dim=-1), n)
        torch.testing.assert_close(probs, want_p, rtol=1e-5, atol=1e-9)
        # Ids agree wherever a probability is not tied with a neighbour's.
        pad = torch.full((rows, 1), -1.0)
        before, after = torch.cat([pad, want_p[:, :-1]], 1), torch.cat([want_p[:, 1:], pad], 1)
        distinct = (want_p != before) & (want_p != after) & (want_p > 0)
        assert torch.equal(ids[distinct], want_ids[distinct])
        assert (probs[x.gather(1, ids) == float("-inf")] == 0).all()  # removed: never drawn
    x = torch.randn(3, 100)
    x[0, 7] = float("nan")
    x[1] = float("-inf")
    probs, _ = torch.ops.dsinfer.softmax_top_candidates(x, torch.ones(3), 10)
    assert probs[:2].isnan().all() and probs[2].isfinite().all()


def test_whole_row_op_draws_only_what_the_row_allows():
    """sample_full_rows: removed tokens (-inf) are never drawn, whatever the uniform (0, the
    edges of blocks, just below 1); a row without a distribution answers -1."""
    from dsinfer.layers.kernels.cpu_build import load_cpu_ops

    assert load_cpu_ops() is None
    x = torch.full((5, 600), float("-inf"))
    x[0, 257] = 0.0  # one token, in the second block of 256
    x[1, [3, 599]] = torch.tensor([1.0, 2.0])  # the first token and the last of a partial block
    x[2] = torch.randn(600)
    x[3, 10] = float("nan")
    x[4] = float("-inf")  # nothing allowed
    for u in (0.0, 0.25, 0.5, 1 - 1e-12):
        ids = torch.ops.dsinfer.sample_full_rows(
            x, torch.ones(5), torch.full((5,), u, dtype=torch.float64)
        )
        assert ids[0] == 257 and ids[1] in (3, 599) and 0 <= ids[2] < 600
        assert ids[3] == -1 and ids[4] == -1
    ids = [torch.ops.dsinfer.sample_full_rows(x[1:2], torch.ones(1), torch.tensor([u], dtype=torch.float64)).item() for u in (0.1, 0.9)]  # fmt: skip
    assert ids == [3, 599]  # e / (e + e²) = 0.27: the inverse CDF in order


_VOCAB = 600  # more than the 256 top-p candidates: both paths of draw_sampled run


def _lm_like_row(sharpness: float, seed: int) -> torch.Tensor:
    """Zipf-shaped logits over a shuffled vocabulary, like a model's next-token row."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, _VOCAB + 1, dtype=torch.float32)
    return (-sharpness * ranks.log())[torch.randperm(_VOCAB, generator=g)]


def _draw_many(row: torch.Tensor, params: SamplingParams, n: int = 6000) -> torch.Tensor:
    """Frequencies of n draws of one row, each by its own generator (one batched call)."""
    states = [SamplerState(params, [], torch.Generator().manual_seed(s)) for s in range(n)]
    tokens, _ = Sampler()(row.expand(n, -1).contiguous(), states)
    return torch.bincount(torch.tensor(tokens), minlength=_VOCAB).float() / n


@pytest.mark.parametrize(
    ("sharpness", "kw"),
    [
        (1.2, dict(temperature=1.0)),  # whole vocabulary: the two-level inverse CDF
        (1.2, dict(temperature=0.7, top_p=0.9)),  # nucleus inside the candidates
        (1.2, dict(temperature=1.0, top_k=20)),
        (1.2, dict(temperature=0.8, top_k=50, top_p=0.8, min_p=0.05)),
        (0.3, dict(temperature=1.0, top_p=0.95)),  # flat: nucleus past 256, the full sort
        (0.3, dict(temperature=1.5, min_p=0.5)),
        (0.3, dict(temperature=1.0, top_k=100, top_p=0.5)),  # nucleus of the top-k renormalised
    ],
)
def test_batched_draws_follow_the_filtered_distribution(sharpness, kw, candidates_path):
    row = _lm_like_row(sharpness, seed=7)
    params = SamplingParams(**kw)
    want = torch.softmax(filter_logits(row.clone(), params), dim=-1)
    got = _draw_many(row, params)
    assert got[want == 0].sum() == 0  # never outside the support
    assert (got - want).abs().max() < 0.02, (got - want).abs().max()


def test_candidate_and_full_paths_give_the_same_support(candidates_path):
    # top-p rows whose nucleus fits in the candidates against filter_rows' support, for many
    # parameter combinations: every token drawn is in it, and most of it is drawn.
    for seed, (k, p, m) in enumerate([(-1, 0.5, 0.0), (3, 1.0, 0.0), (40, 0.99, 0.1)]):
        row = _lm_like_row(1.5, seed)
        params = SamplingParams(temperature=0.9, top_k=k, top_p=p, min_p=m)
        support = filter_logits(row.clone(), params) != float("-inf")
        drawn = _draw_many(row, params, n=3000) > 0
        assert not (drawn & ~support).any()
        assert drawn.sum() >= min(int(support.sum()), 3)


def test_draw_never_picks_a_zero_probability_token():
    from dsinfer.worker.token_draw import draw_tokens

    probs = torch.zeros(64, 1000)
    probs[:, 257] = 1.0  # one token in the second block of 256
    probs[::2, 999] = 3.0  # and the last token of a partial block on even rows
    u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    tokens = draw_tokens(probs, u)
    assert set(tokens) <= {257, 999}
    assert all(t == 257 for t in tokens[1::2])


def test_a_row_of_nan_logits_does_not_stop_the_batch(candidates_path):
    rows = torch.randn(3, _VOCAB)
    rows[1] = float("nan")
    states = [_state(seed=s, temperature=0.8, top_p=0.9) for s in range(3)]
    tokens, _ = Sampler()(rows, states)
    assert len(tokens) == 3 and all(0 <= t < _VOCAB for t in tokens)
    plain = [_state(seed=s, temperature=0.8) for s in range(3)]
    tokens, _ = Sampler()(rows, plain)
    assert all(0 <= t < _VOCAB for t in tokens)


def test_candidate_op_completes_the_rows_the_torch_rule_completes(monkeypatch):
    """draw_candidates (one C++ call) against the torch ops it stands in for: the same rows
    are complete (their support ends within the candidates), and every draw lies in
    filter_rows' support, for rows from flat to sharp under top-k, top-p and min-p."""
    from dsinfer.layers.kernels.cpu_build import load_cpu_ops
    from dsinfer.worker import token_draw

    assert load_cpu_ops() is None
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, _VOCAB, generator=g) * torch.linspace(0.2, 6.0, 64)[:, None]
    params = [
        SamplingParams(
            temperature=0.9,
            top_k=(-1, 5, 300, 40)[i % 4],
            top_p=(1.0, 0.5, 0.9, 0.99)[i // 4 % 4],
            min_p=(0.0, 0.2)[i // 16 % 2],
        )
        for i in range(64)
    ]
    u = torch.rand(64, dtype=torch.float64, generator=g)
    rows = list(range(64))

    def draw(op: bool) -> tuple[list[int], list[int | None]]:
        real = token_draw._cpu_ops
        monkeypatch.setattr(
            token_draw,
            "_cpu_ops",
            lambda x, name: real(x, name) and (op or name != "draw_candidates"),
        )
        picks: list[int | None] = [None] * 64
        return token_draw._draw_from_candidates(logits, params, u, rows, 48, picks), picks

    left_op, picks_op = draw(True)
    left_torch, picks_torch = draw(False)
    assert left_op == left_torch and 0 < len(left_op) < 64
    for j in rows:
        assert (picks_op[j] is None) == (picks_torch[j] is None)
        if picks_op[j] is not None:
            support = filter_logits(logits[j].clone(), params[j]) != float("-inf")
            assert support[picks_op[j]], (j, params[j])
