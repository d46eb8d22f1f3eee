"""Drawing tokens for a batch of sampled rows: truncation (top-k, top-p, min-p) and the draw.

Everything runs on the whole batch at once: the per-row loop it replaces (a sort of the whole
vocabulary for top-p, an exponential noise row for the draw) cost ~5 ms a row at SmolLM2's 49k
vocabulary, more than the 16-row decode step itself. Rows whose support is short (top-k, or a
top-p nucleus that ends within the top 256, then 4,096, tokens, as a model's nucleus almost
always does) are drawn from their top candidates; the others from the whole row. Each row draws
one uniform number from its own generator, once, whatever path then uses it: a seed gives the
same text in any batch.
"""

from __future__ import annotations

import torch

from dsinfer.sampling import SamplingParams

# The top candidates draw_sampled examines for a row's support, in turn, before a full sort of
# the row: a model's nucleus at top_p ≤ 0.95 is almost always within 256 tokens; SmolLM2 at
# temperature 1.0 / top-p 0.95 has ~20-25% of its nuclei past 256 (~60% at top-p 0.99), and a
# top-4096 is ~5x cheaper than the sort of 49k it spares.
_CANDIDATE_TIERS = (256, 4096)


def _per_row(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)  # [B, 1]


def filter_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, each row [B, V] with its own parameters;
    removed tokens become -inf. The reference of what draw_sampled draws from."""
    x = logits / _per_row([p.temperature for p in params], logits)
    return _truncate(x, params)


def _truncate(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """filter_rows after the temperature."""
    vocab = x.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(ks) < vocab:
        kmax = max(k for k in ks if k < vocab)
        top = torch.topk(x, kmax).values  # [B, kmax], descending
        kth = top.gather(1, torch.tensor([[min(k, kmax) - 1] for k in ks], device=x.device))
        kth[torch.tensor([k == vocab for k in ks], device=x.device)] = float("-inf")
        x = x.masked_fill(x < kth, float("-inf"))
    if min(p.top_p for p in params) < 1.0:
        x = x.masked_fill(_outside_nucleus(x, [p.top_p for p in params]), float("-inf"))
    if max(p.min_p for p in params) > 0.0:
        probs = torch.softmax(x, dim=-1)
        floor = _per_row([p.min_p for p in params], probs) * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < floor, float("-inf"))
    return x


def _outside_nucleus(x: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """[B, V] True where a token is outside its row's nucleus: the smallest prefix of the row's
    tokens by falling probability whose mass reaches top_p (always at least the top token).
    The rows with a nucleus are sorted whole: draw_sampled sends here only the rows whose
    nucleus outgrew its candidate tiers, so a top-k step first would be wasted work."""
    probs = torch.softmax(x, dim=-1)
    outside = torch.zeros_like(probs, dtype=torch.bool)
    rows = [j for j, p in enumerate(top_p) if p < 1.0]  # top_p 1 keeps everything
    if rows:
        sel = torch.tensor(rows, device=x.device)
        p_sorted, order = torch.sort(probs[sel], dim=-1, descending=True)
        limit = _per_row([top_p[j] for j in rows], probs)
        drop_sorted = (torch.cumsum(p_sorted, dim=-1) - p_sorted) >= limit
        outside[sel] = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return outside


_DRAW_BLOCK = 256  # tokens a block in draw_tokens' two-level search


def draw_tokens(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """One token per row of probs [B, V] (rows need not be normalised; zeros are never drawn):
    the inverse of each row's cumulative distribution at its uniform u [B] (fp64, in [0, 1),
    from the row's own generator), so a row's draw never depends on the others.

    Two levels, so that no float64 pass runs over the whole vocabulary (a cumsum over
    [16, 49152] cost ~2 ms here): the draw picks a block of 256 tokens by the blocks' masses,
    then a token inside the block, each search over float64 sums."""
    b, vocab = probs.shape
    pad = -vocab % _DRAW_BLOCK
    padded = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = padded.view(b, -1, _DRAW_BLOCK)  # [B, NB, 256]
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [B, NB]
    u = u.to(probs.device) * block_cdf[:, -1]  # [B], in [0, mass)
    # right=True: the first entry whose cumulative mass exceeds u; an entry of zero mass has an
    # empty interval and is never chosen.
    nb = block_cdf.shape[1]
    block = torch.searchsorted(block_cdf, u.unsqueeze(1), right=True).squeeze(1).clamp_(max=nb - 1)
    before = torch.where(
        block > 0, block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1))[:, 0], 0.0
    )
    inner = blocks[torch.arange(b, device=probs.device), block].double()  # [B, 256]
    inner_cdf = inner.cumsum(dim=-1)
    # The offset inside the block, rescaled to the block's own float64 sum (the block sums
    # above were float32): u stays strictly inside the block's mass.
    mass = block_cdf.gather(1, block.unsqueeze(1))[:, 0] - before
    offset = ((u - before) / mass).clamp_(0.0, 1.0) * inner_cdf[:, -1]
    slot = torch.searchsorted(inner_cdf, offset.unsqueeze(1), right=True).squeeze(1)
    slot = slot.clamp_(max=_DRAW_BLOCK - 1)
    tokens = block * _DRAW_BLOCK + slot
    picked = inner.gather(1, slot.unsqueeze(1))[:, 0]
    out = tokens.tolist()
    # Rounding can land u on the very end of the support (offset == mass): take the last token
    # with mass in that block instead.
    for row in torch.nonzero(~(picked > 0)).flatten().tolist():
        nonzero = torch.nonzero(inner[row] > 0).flatten()
        if len(nonzero):
            out[row] = int(block[row]) * _DRAW_BLOCK + int(nonzero[-1])
        else:  # a row without finite mass (NaN logits)
            out[row] = _nan_argmax(probs[row])
    return out


def _uniforms(generators: list[torch.Generator], device: torch.device) -> torch.Tensor:
    """One fp64 uniform in [0, 1) from each row's generator, drawn on the generator's device (a
    request's generator lives where the model runs) → [B] on `device`."""
    return torch.cat([_draw_one(g) for g in generators]).to(device)


def _draw_one(generator: torch.Generator) -> torch.Tensor:
    """A row's one number: [1] fp64 in [0, 1) on the generator's device."""
    return torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device)


def skip_draws(generator: torch.Generator, n: int) -> None:
    """Advance a generator past n rows' numbers, as n draws would (speculative verification
    gives back the rows it drew but did not emit: worker/spec_decode.py)."""
    for _ in range(n):
        _draw_one(generator)


def _nan_argmax(row: torch.Tensor) -> int:
    """The token of a row without a distribution (NaN logits): its argmax, as greedy takes it."""
    return int(torch.nan_to_num(row, nan=-1.0).argmax())


def _short_support(p: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p cut the row: its support may lie within a candidate tier."""
    return 0 < p.top_k < vocab or p.top_p < 1.0


def draw_sampled(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """A token for each row of logits [B, V] (fp32), drawn from filter_rows' distribution."""
    vocab = logits.shape[-1]
    u = _uniforms(generators, logits.device)  # [B]: each row's one number, whatever its path
    picks: list[int | None] = [None] * len(params)
    # Rows with a short support try the candidate tiers in turn; the rest (and a nucleus
    # longer than the last tier) are drawn from the whole row.
    pending = [j for j, p in enumerate(params) if _short_support(p, vocab)]
    for n in _CANDIDATE_TIERS:
        if not pending:
            break
        pending = _draw_from_candidates(logits, params, u, pending, n, picks)
    rest = [j for j, token in enumerate(picks) if token is None]
    if rest and _cpu_ops(logits, "sample_full_rows"):
        # Temperature alone (the OpenAI default): the whole row, in one C++ pass a row.
        whole = [j for j in rest if params[j].min_p <= 0.0 and not _short_support(params[j], vocab)]
        if whole:
            _draw_whole_rows(logits, params, u, whole, picks)
            rest = [j for j in rest if picks[j] is None]
    if rest:
        lr = logits[rest] if len(rest) < len(picks) else logits
        pr = [params[j] for j in rest]
        xr = lr / _per_row([p.temperature for p in pr], lr)
        probs = torch.softmax(_truncate(xr, pr), dim=-1)
        for j, token in zip(rest, draw_tokens(probs, u[rest]), strict=True):
            picks[j] = token
    return picks  # type: ignore[return-value]


def top_probabilities(
    logits: torch.Tensor, temperatures: list[float], n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The n most probable tokens of each row of softmax(logits [R, V] / temperature), in
    falling order: probabilities [R, n] and ids [R, n]. A row without a finite distribution
    (NaN logits, every token removed) gets NaN probabilities."""
    if _cpu_ops(logits, "softmax_top_candidates"):
        # One C++ pass a row (layers/kernels/cpu_ops.cpp): 16 rows of a 49k vocabulary in
        # ~0.35 ms, against ~3.7 ms for the division, softmax and top-k below.
        t = torch.tensor(temperatures, dtype=torch.float32)
        return torch.ops.dsinfer.softmax_top_candidates(logits.contiguous(), t, n)
    probs = torch.softmax(logits / _per_row(temperatures, logits), dim=-1)
    return torch.topk(probs, n)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of logits [B, V] (fp32): torch.argmax's tokens (the first largest;
    a row with NaN: its first NaN), from one vectorised pass a row where the C++ op runs
    (16 rows of a 49k vocabulary: ~0.05 against ~0.25-0.3 ms)."""
    if _cpu_ops(logits, "argmax_rows"):
        return torch.ops.dsinfer.argmax_rows(logits.contiguous()).tolist()
    return logits.argmax(dim=-1).tolist()


def _cpu_ops(logits: torch.Tensor, op: str) -> bool:
    """Whether the C++ op `op` takes these logits: fp32 on the CPU, with the fused kernels
    loaded already (the fused backend loads them; sampling never starts a build)."""
    from dsinfer.layers.kernels.cpu_build import kernels_loaded

    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not kernels_loaded():
        return False
    return hasattr(torch.ops.dsinfer, op)


def _draw_whole_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    u: torch.Tensor,
    rows: list[int],
    picks: list[int | None],
) -> None:
    """Draw `rows` (no truncation) from softmax(logits / temperature) into `picks`: the same
    rule as draw_tokens (the row's fp64 uniform u, the inverse of the cumulative distribution
    over blocks of 256 tokens, then inside the block)."""
    ls = logits[rows] if len(rows) < logits.shape[0] else logits
    t = torch.tensor([params[j].temperature for j in rows], dtype=torch.float32)
    ids = torch.ops.dsinfer.sample_full_rows(ls.contiguous(), t, u[rows].cpu()).tolist()
    for r, (j, token) in enumerate(zip(rows, ids, strict=True)):
        picks[j] = token if token >= 0 else _nan_argmax(ls[r])  # -1: no distribution


def _draw_from_candidates(
    logits: torch.Tensor,
    params: list[SamplingParams],
    u: torch.Tensor,
    rows: list[int],
    candidates: int,
    picks: list[int | None],
) -> list[int]:
    """Draw into `picks` the `rows` whose support lies within their top `candidates` tokens
    (top-k, or a top-p nucleus that ends there); returns the rows it could not. The same
    support as _truncate: top-k first, top-p over the top-k renormalised distribution, then
    min-p (a ratio to the top token)."""
    vocab = logits.shape[-1]
    kr = [params[j].top_k if 0 < params[j].top_k < vocab else vocab for j in rows]
    ls = logits[rows] if len(rows) < logits.shape[0] else logits
    n = min(vocab, max([candidates, *(k for k in kr if k < vocab)]))
    probs, ids = top_probabilities(ls, [params[j].temperature for j in rows], n)  # [R, n]
    if _cpu_ops(logits, "draw_candidates"):
        # The rule below in one C++ call (cpu_ops.cpp's draw_candidates; the same support).
        slots = torch.ops.dsinfer.draw_candidates(
            probs,
            torch.tensor(kr),
            torch.tensor([params[j].top_p for j in rows], dtype=torch.float32),
            torch.tensor([params[j].min_p for j in rows], dtype=torch.float32),
            u[rows].cpu(),
            vocab,
        ).tolist()
        left = []
        for r, (j, slot) in enumerate(zip(rows, slots, strict=True)):
            if slot >= 0:
                picks[j] = int(ids[r, slot])
            else:
                left.append(j)
        return left
    k_rows = torch.tensor(kr, device=logits.device)
    keep = torch.arange(n, device=logits.device).unsqueeze(0) < k_rows.unsqueeze(1)
    q = probs * keep
    # Renormalised over the top-k when there is one (filter_rows applies top-k first); the
    # full softmax is normalised already.
    q = q / torch.where(k_rows < vocab, q.sum(dim=-1), 1.0).unsqueeze(1)
    top_p = torch.tensor([params[j].top_p for j in rows], dtype=q.dtype, device=logits.device)
    in_nucleus = (torch.cumsum(q, dim=-1) - q) < top_p.unsqueeze(1)
    keep &= in_nucleus | (top_p >= 1.0).unsqueeze(1)
    # Complete: the support is the top-k's (within the candidates), or the nucleus ended
    # before the last candidate; a row without a distribution goes on to the full path.
    complete = ((k_rows <= n) | ~keep[:, -1]) & torch.isfinite(probs[:, 0])
    min_p = _per_row([params[j].min_p for j in rows], q)
    keep &= q >= min_p * q[:, :1]
    # Only the complete rows draw here; the others keep their number for the next path.
    done = torch.nonzero(complete).flatten().tolist()
    if done:
        sel = torch.tensor(done, device=logits.device)
        slots = draw_tokens((q * keep)[sel], u[[rows[r] for r in done]])
        for r, slot in zip(done, slots, strict=True):
            picks[rows[r]] = int(ids[r, slot])
    finished = set(done)
    return [j for r, j in enumerate(rows) if r not in finished]
