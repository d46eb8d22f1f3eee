"""Multi-token prediction: a tiny DeepSeek-V3 checkpoint that carries its MTP layer drafts for
itself; greedy output with MTP on equals output with it off; the acceptance rate is reported."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.worker.step_io import ModelRunnerOutput
from tests.helpers import DEEPSEEK_COMMON as COMMON
from tests.helpers import MTP_GREEDY as GREEDY
from tests.helpers import MTP_PROMPTS as PROMPTS
from tests.helpers import MTP_V3 as V3
from tests.helpers import assert_pool_clean


def _llm(path, **kw) -> LLM:  # noqa: ANN001
    return LLM(str(path), dtype="float32", num_blocks=96, block_size=4, **kw)


@pytest.fixture(scope="module")
def mtp_path(mtp_dir):
    return mtp_dir[0]


def test_mtp_layer_is_loaded_with_its_own_latent_cache_layer(mtp_path, mtp_dir):
    on, off = _llm(mtp_path), _llm(mtp_path, mtp=False)
    runner = on.engine.executor.runner
    assert runner.drafter is not None and off.engine.executor.runner.drafter is None
    assert len(runner.kv_caches) == 4 and len(off.engine.executor.runner.kv_caches) == 3
    latent = COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"]
    assert on.engine.kv_bytes_per_token == 4 * latent * 4  # 3 layers + MTP, fp32
    saved = mtp_dir[3]
    assert torch.equal(runner.model.mtp.eh_proj.weight, saved["model.layers.3.eh_proj.weight"])
    assert torch.equal(
        runner.model.mtp.self_attn.kv_b_proj.weight,
        saved["model.layers.3.self_attn.kv_b_proj.weight"],
    )


def test_greedy_with_mtp_equals_greedy_without(mtp_path):
    on, off = _llm(mtp_path), _llm(mtp_path, mtp=False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got, ref = on.generate(prompts, GREEDY), off.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in got)
    assert drafted > 40, "every decode step after the first verifies a draft"
    assert 0 <= accepted <= drafted
    print(f"MTP acceptance on the tiny random model: {accepted}/{drafted}")
    assert all(o.metrics.num_draft_tokens == 0 for o in ref)
    sched = on.engine.scheduler
    assert (sched.num_draft_tokens, sched.num_accepted_draft_tokens) == (drafted, accepted)
    assert_pool_clean(on.engine)


# Sampled requests that touch every part of the sampler a verified row goes through.
SAMPLED = [
    SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=24, ignore_eos=True),
    SamplingParams(
        temperature=1.0,
        top_k=40,
        seed=7,
        max_tokens=24,
        ignore_eos=True,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={5: 3.0},
        logprobs=2,
    ),
]


@pytest.mark.parametrize("params", SAMPLED, ids=["top_p", "penalties_bias_logprobs"])
def test_sampled_with_mtp_equals_sampled_without(mtp_path, params):
    """Sampled requests are drafted too, and each verified row is drawn as a plain step draws
    it (its generator's next number, its penalties over the tokens before it): a seed gives
    the same tokens and logprobs with MTP on as off."""
    on, off = _llm(mtp_path), _llm(mtp_path, mtp=False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got, ref = on.generate(prompts, params), off.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    if params.logprobs is not None:
        for g, r in zip(got, ref, strict=True):
            assert len(g.outputs[0].logprobs) == len(r.outputs[0].logprobs) == 24
            for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
                assert (a.token_id, a.rank) == (b.token_id, b.rank)
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert sum(o.metrics.num_draft_tokens for o in got) > 40
    assert_pool_clean(on.engine)


def test_a_stop_string_inside_a_verified_run_ends_the_output_there(mtp_path):
    """A stop string that a step's first token completes, with an accepted draft's token after
    it: the output ends where a token-a-step decode ends it (the token after is taken back),
    text, tokens, logprobs and finish reason alike."""
    off = _llm(mtp_path, mtp=False)
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    free = off.generate(prompt, GREEDY)[0].outputs[0]
    full = {0: PROMPTS[2] + list(free.token_ids)}
    words = free.text.split()  # one word a token ("w291", …); it loops for its first dozen
    checked = 0
    for at in range(12, 20):  # stop strings completed at consecutive tokens: both parities
        stop = words[at]
        if stop in " ".join(words[:at]):
            continue  # earlier text would stop there
        params = SamplingParams(
            temperature=0, max_tokens=32, ignore_eos=True, stop=[stop], logprobs=1
        )
        want = off.generate(prompt, params)[0]
        llm = _llm(mtp_path, mtp=False)
        llm.engine.executor.runner.drafter = OracleDrafter(full, "1")  # every draft right
        got = llm.generate(prompt, params)[0]
        g, w = got.outputs[0], want.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            w.token_ids,
            w.text,
            "stop",
            stop,
        )
        assert [e.token_id for e in g.logprobs] == list(g.token_ids)
        assert got.metrics.num_accepted_draft_tokens > 0
        assert_pool_clean(llm.engine)
        checked += 1
    assert checked >= 4


class OracleDrafter:
    """Proposes the known next token on a fixed right/wrong pattern: drives verification
    through acceptance and rejection at chosen steps (a narrow unit-test double)."""

    def __init__(self, reference: dict[int, list[int]], pattern: str) -> None:
        self.reference, self.pattern, self.calls = reference, pattern, 0

    def propose(self, inp, hidden, result: ModelRunnerOutput, wants, driver=True) -> None:  # noqa: ANN001
        for s in inp.seqs:
            if s.req_id not in result.sampled or s.req_id not in wants:
                continue
            ref = self.reference[int(s.req_id.rsplit("-", 1)[1])]
            done = (
                s.start_pos
                + len(s.token_ids)
                - s.num_draft
                + 1
                + len(result.bonus.get(s.req_id, []))
            )
            right = self.pattern[self.calls % len(self.pattern)] == "1"
            self.calls += 1
            if done < len(ref):
                result.drafts[s.req_id] = [ref[done] if right else (ref[done] + 1) % 320]

    def forget(self, req_id: str) -> None:
        pass


@pytest.mark.parametrize("params", [GREEDY, SAMPLED[1]], ids=["greedy", "sampled"])
def test_verification_accepts_and_rejects_exactly(mtp_path, params):
    """Drafts right or wrong on a fixed pattern: the output is plain decoding's (for a sampled
    request, with the same seed: a right draft is accepted because the row draws what the
    plain step drew), and the accepted share follows the pattern."""
    off = _llm(mtp_path, mtp=False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = off.generate(prompts, params)
    full = {i: PROMPTS[i] + list(o.outputs[0].token_ids) for i, o in enumerate(ref)}
    llm = _llm(mtp_path, mtp=False)
    oracle = OracleDrafter(full, "1101")
    llm.engine.executor.runner.drafter = oracle
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in got)
    assert drafted > 0 and 0.55 < accepted / drafted < 0.95, (accepted, drafted)
    # Accepted drafts mean fewer steps: each accepted draft saves one decode step.
    assert all(o.metrics.draft_acceptance_rate is not None for o in got)
    assert_pool_clean(llm.engine)


@torch.inference_mode()
def test_mtp_draft_matches_a_reference_computation(mtp_dir):
    """The draft after prefill, recomputed with transformers' modules: the main model's normed
    states, eh_proj over [enorm(embed(next)); hnorm(h)], the twin's decoder layer (the MTP
    weights) under a causal mask, shared_head.norm, the shared LM head."""
    path, model, twin, mtp = mtp_dir
    prompt = PROMPTS[2]
    llm = _llm(path)
    runner = llm.engine.executor.runner
    seen: list[dict] = []
    original = runner.drafter.propose

    def record(inp, hidden, result, wants, driver=True):  # noqa: ANN001, ANN202
        original(inp, hidden, result, wants, driver)
        seen.append(dict(result.drafts))

    runner.drafter.propose = record
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2))
    first = out[0].outputs[0].token_ids[0]
    ours = next(iter(seen[0].values()))[0]

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + V3.get("rms_norm_eps", 1e-6)) * w

    ids = torch.tensor([prompt])
    h = model.model(input_ids=ids).last_hidden_state  # [1, T, H], after the final norm
    nxt = torch.tensor([prompt[1:] + [first]])
    e = model.model.embed_tokens(nxt)
    m = "model.layers.3."
    x = torch.cat([rms(e, mtp[m + "enorm.weight"]), rms(h, mtp[m + "hnorm.weight"])], dim=-1)
    x = x @ mtp[m + "eh_proj.weight"].t()
    t = len(prompt)
    pos = torch.arange(t).unsqueeze(0)
    causal = torch.full((t, t), float("-inf")).triu(1).view(1, 1, t, t)
    layer = twin.model.layers[3]
    y = layer(
        x,
        attention_mask=causal,
        position_ids=pos,
        position_embeddings=twin.model.rotary_emb(x, pos),
    )
    y = y[0] if isinstance(y, tuple) else y
    logits = rms(y, mtp[m + "shared_head.norm.weight"]) @ model.lm_head.weight.t()
    assert ours == int(logits[0, -1].argmax())


@pytest.mark.parametrize(
    ("regex", "binds_every_token"),
    [
        ("(w[13579]){1,40}", True),  # only w1, w3, w5, w7, w9
        # Any tokens, but the text may end only after an odd number: most drafts pass.
        ("(w[0-9]+)*w[0-9]*[13579]", False),
    ],
)
def test_constrained_greedy_with_mtp_equals_without(mtp_path, regex, binds_every_token):
    """Drafts of a constrained request are checked against its grammar: output with MTP on
    equals output with it off, and every output is in the grammar's language."""
    import re

    from dsinfer.structured import StructuredOutputs

    on, off = _llm(mtp_path), _llm(mtp_path, mtp=False)
    params = SamplingParams(
        temperature=0.0, max_tokens=24, structured=StructuredOutputs(regex=regex)
    )
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got, ref = on.generate(prompts, params), off.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    eos = on.tokenizer.eos_token_ids
    for o in got:
        words = [f"w{t}" for t in o.outputs[0].token_ids if t not in eos]
        if o.outputs[0].finish_reason == "stop":
            assert re.fullmatch(regex, "".join(words)), words
        elif binds_every_token:
            assert re.fullmatch("(w[13579])*", "".join(words)), words
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in got)
    assert drafted > 0 and accepted <= drafted, "constrained requests are drafted"
    # (This random MTP layer never agrees with its model, unconstrained either: acceptance
    # through the grammar is tested in tests/structured/test_grammar.py.)
    assert_pool_clean(on.engine)


def test_constrained_sampled_drafts_verify_like_plain_sampling(mtp_path):
    """A sampled request under a grammar, drafts right 3 times in 4 (the oracle): its check
    rows are drawn a row at a time through the grammar, and the output is plain sampling's
    with the same seed, in the grammar's language."""
    import re

    from dsinfer.structured import StructuredOutputs

    regex = "(w[0-9]+)*w[0-9]*[13579]"
    params = SamplingParams(
        temperature=0.9, seed=11, max_tokens=24, structured=StructuredOutputs(regex=regex)
    )
    off = _llm(mtp_path, mtp=False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = off.generate(prompts, params)
    full = {i: PROMPTS[i] + list(o.outputs[0].token_ids) for i, o in enumerate(ref)}
    llm = _llm(mtp_path, mtp=False)
    llm.engine.executor.runner.drafter = OracleDrafter(full, "1101")
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert sum(o.metrics.num_accepted_draft_tokens for o in got) > 10
    eos = llm.tokenizer.eos_token_ids
    for o in got:
        if o.outputs[0].finish_reason == "stop":
            words = [f"w{t}" for t in o.outputs[0].token_ids if t not in eos]
            assert re.fullmatch(regex, "".join(words)), words
    assert_pool_clean(llm.engine)


@pytest.mark.parametrize("params", [GREEDY, *SAMPLED], ids=["greedy", "top_p", "penalties"])
def test_chained_mtp_drafts_give_the_tokens_without_mtp(mtp_path, params):
    """A chain of three MTP drafts a step (the layer fed its own output and draft): each is
    verified exactly, so greedy and seeded sampled outputs equal MTP off's; three drafts are
    verified a step, the lookahead slots they write go back with the request."""
    on, off = _llm(mtp_path, mtp_drafts=3), _llm(mtp_path, mtp=False)
    assert on.engine.executor.runner.drafter.lookahead == 2 and on.engine.scheduler.lookahead == 2
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got, ref = on.generate(prompts, params), off.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    steps = sum(len(o.outputs[0].token_ids) for o in got)
    assert drafted > 2 * steps // 2, "most decode steps verify a chain of three"
    assert_pool_clean(on.engine)


def test_chained_drafts_in_a_small_pool_shorten_instead_of_preempting(mtp_path):
    """Where the pool has no block for the lookahead, the chain is shorter (or a draft alone):
    the outputs stay MTP off's and no request is preempted for a lookahead slot."""
    small = LLM(str(mtp_path), dtype="float32", num_blocks=22, block_size=4, mtp_drafts=4)
    off = _llm(mtp_path, mtp=False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got, ref = small.generate(prompts, GREEDY), off.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert_pool_clean(small.engine)


@torch.inference_mode()
def test_the_chained_drafts_match_a_reference_computation(mtp_dir):
    """The second and third drafts after prefill, recomputed with transformers' modules: the
    MTP layer's un-normed output at the previous position with the previous draft's
    embedding, one position on, attending to the prompt's MTP states and the chain's own."""
    path, model, twin, mtp = mtp_dir
    prompt = PROMPTS[2]
    llm = _llm(path, mtp_drafts=3)
    runner = llm.engine.executor.runner
    seen: list[dict] = []
    original = runner.drafter.propose

    def record(inp, hidden, result, wants, driver=True):  # noqa: ANN001, ANN202
        original(inp, hidden, result, wants, driver)
        seen.append({k: list(v) for k, v in result.drafts.items()})

    runner.drafter.propose = record
    heads: list[torch.Tensor] = []  # what the drafter hands the LM head: first, then chained
    logits_of = runner.model.compute_logits

    def recorded(h: torch.Tensor) -> torch.Tensor:
        heads.append(h.clone())
        return logits_of(h)

    runner.model.compute_logits = recorded
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2))
    first = out[0].outputs[0].token_ids[0]
    d1, d2, d3 = next(iter(seen[0].values()))
    chained = heads[2:4]  # after the prefill's sampled row and the first draft's row

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + V3.get("rms_norm_eps", 1e-6)) * w

    m = "model.layers.3."
    layer = twin.model.layers[3]

    def mtp_layer(x: torch.Tensor) -> torch.Tensor:  # [1, T, H] under a causal mask
        t = x.shape[1]
        pos = torch.arange(t).unsqueeze(0)
        causal = torch.full((t, t), float("-inf")).triu(1).view(1, 1, t, t)
        y = layer(
            x,
            attention_mask=causal,
            position_ids=pos,
            position_embeddings=twin.model.rotary_emb(x, pos),
        )
        return y[0] if isinstance(y, tuple) else y

    def head(y: torch.Tensor) -> int:
        return int((rms(y, mtp[m + "shared_head.norm.weight"]) @ model.lm_head.weight.t()).argmax())

    def mix(e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = torch.cat([rms(e, mtp[m + "enorm.weight"]), rms(h, mtp[m + "hnorm.weight"])], dim=-1)
        return x @ mtp[m + "eh_proj.weight"].t()

    ids = torch.tensor([prompt])
    h = model.model(input_ids=ids).last_hidden_state  # [1, T, H]
    x = mix(model.model.embed_tokens(torch.tensor([prompt[1:] + [first]])), h)
    y = mtp_layer(x)
    assert head(y[0, -1]) == d1
    # Chained: the first draft's embedding and the layer's own un-normed output, one on.
    x2 = torch.cat([x, mix(model.model.embed_tokens(torch.tensor([[d1]])), y[:, -1:])], dim=1)
    y2 = mtp_layer(x2)[0, -1]
    assert head(y2) == d2
    want = rms(y2, mtp[m + "shared_head.norm.weight"])  # the state the LM head reads
    torch.testing.assert_close(chained[0][0], want, atol=1e-4, rtol=1e-4)
    # The third: the second's embedding and the layer's un-normed output there, one more on.
    x4 = torch.cat([x2, mix(model.model.embed_tokens(torch.tensor([[d2]])), y2.view(1, 1, -1))], 1)
    y4 = mtp_layer(x4)[0, -1]
    assert head(y4) == d3
    torch.testing.assert_close(
        chained[1][0], rms(y4, mtp[m + "shared_head.norm.weight"]), atol=1e-4, rtol=1e-4
    )
    # Fed back normed (the state the head reads) instead, the chain's state would differ.
    normed = rms(y[:, -1:], mtp[m + "shared_head.norm.weight"])
    x3 = torch.cat([x, mix(model.model.embed_tokens(torch.tensor([[d1]])), normed)], dim=1)
    assert (mtp_layer(x3)[0, -1] - y2).abs().max() > 1e-2


def test_mtp_drafts_out_of_range_are_refused(mtp_path):
    with pytest.raises(
        ValueError, match="mtp_drafts: draft tokens a step from the MTP layer must be 1 to 8"
    ):
        _llm(mtp_path, mtp_drafts=9)
