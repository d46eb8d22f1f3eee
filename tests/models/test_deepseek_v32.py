"""DeepSeek-V3.2 (DeepSeek Sparse Attention) against transformers' DeepseekV32ForCausalLM: a
tiny random checkpoint whose indexer keeps 8 tokens per query, so that prompts of 9-40 tokens
attend sparsely. Logits at every position (prefill path and decode path), greedy tokens in a
batch with chunked prefill, preemption and prefix-cache hits, the cache layout."""

from __future__ import annotations

import pytest
import torch

from dsinfer import SamplingParams
from tests.helpers import (
    DEEPSEEK_V32_TOPK,
    VOCAB,
    assert_batched_greedy_matches,
    assert_logits_match,
    assert_pool_clean,
    assert_preempted_chunked_and_cached_runs_match,
    decode_logits,
    save_and_load,
    tiny_deepseek_v32,
)

TOPK = DEEPSEEK_V32_TOPK


def _reference():  # noqa: ANN202
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV32ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV32")
    return tiny_deepseek_v32()


@pytest.fixture(scope="module", params=["reference", "fused"])
def tiny(request, tmp_path_factory):  # noqa: ANN001, ANN201
    model = _reference()
    llm = save_and_load(model, tmp_path_factory.mktemp("v32"), request.param)
    return llm, model


def test_the_indexer_selects_so_sparse_attention_is_not_dense(tiny) -> None:  # noqa: ANN001
    """The check below would pass trivially if the selection changed nothing: here the same
    model attending densely gives other logits past TOPK tokens."""
    _, ref = tiny
    ids = torch.arange(3, 43).unsqueeze(0)
    with torch.inference_mode():
        sparse = ref(ids).logits[0]
        for layer in ref.model.layers:
            layer.self_attn.indexer.index_topk = 10**6
        try:
            dense = ref(ids).logits[0]
        finally:
            for layer in ref.model.layers:
                layer.self_attn.indexer.index_topk = TOPK
    assert torch.equal(sparse[:TOPK], dense[:TOPK])
    assert (sparse[TOPK:] - dense[TOPK:]).abs().max() > 1e-2


def test_logits_match_through_prefill(tiny) -> None:  # noqa: ANN001
    llm, ref = tiny
    assert_logits_match(llm, ref, (1, 8, 9, 40), VOCAB, 1e-4)


def test_logits_match_through_decode(tiny) -> None:  # noqa: ANN001
    """One token a step: every row is a decode row, selected from the index cache."""
    llm, ref = tiny
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (30,), generator=g).tolist()
    with torch.inference_mode():  # as the engine runs (MLA caches kv_b's split per weight)
        want = ref(torch.tensor([ids])).logits[0]
        err = (decode_logits(llm.engine, ids).float() - want).abs().max().item()
    assert err < 1e-4, err


def test_greedy_matches_batched_with_chunks(tiny) -> None:  # noqa: ANN001
    llm, ref = tiny
    assert_batched_greedy_matches(llm, ref, (3, 11, 26), VOCAB, 24)


def test_the_cache_keeps_the_latent_and_the_index_keys(tiny) -> None:  # noqa: ANN001
    llm, _ = tiny
    cfg = llm.engine.model_config
    assert cfg.sparse_attention is not None and cfg.sparse_attention.index_topk == TOPK
    assert llm.engine.kv_bytes_per_token == cfg.num_layers * (16 + 8 + 16) * 4
    latent, keys = llm.engine.executor.runner.kv_caches[0]
    assert latent.shape[1:] == (4, 24) and keys.shape[1:] == (4, 16)
    layers = llm.engine.executor.runner.model.model.layers
    # The fused backend's: fused MLA while contexts fit in the selection, the reference's
    # masked decode past it.
    fused = "FusedCpuSparseMLAAttention" if llm.engine.config.backend == "fused" else None
    want = fused or "SparseMLAPagedAttention"
    assert {type(layer.self_attn.attn).__name__ for layer in layers} == {want}


def test_preemption_chunks_and_prefix_cache_hits_keep_the_reference_tokens(tiny, tmp_path) -> None:  # noqa: ANN001
    """Recomputed after preemption, prefilled in chunks of 8, prompts sharing a prefix (cache
    hits: their index keys are read back from cached blocks): the reference's greedy tokens."""
    llm, ref = tiny
    small = save_and_load(
        ref, tmp_path, llm.engine.config.backend, num_blocks=16, max_num_batched_tokens=8
    )
    assert_preempted_chunked_and_cached_runs_match(small, ref)


@pytest.fixture(scope="module")
def v32_src(tmp_path_factory):  # noqa: ANN201
    from tests.helpers import write_tiny_tokenizer

    path = tmp_path_factory.mktemp("v32-src")
    _reference().save_pretrained(path)
    write_tiny_tokenizer(path)
    return path


def test_an_int4_artifact_keeps_the_indexer_float_and_tracks_fp32(v32_src, tmp_path) -> None:  # noqa: ANN001
    """`dsinfer compile --quant int4`: the indexer's projections stay float (and its head
    weights fp32, as the reference keeps them); the artifact's logits follow the fp32 model's
    and it generates on the default backend."""
    from dsinfer import LLM
    from dsinfer.artifact.compiler import CompileOptions, compile_artifact
    from tests.helpers import full_logits

    art = tmp_path / "int4"
    compile_artifact(str(v32_src), art, CompileOptions(quant="int4"))
    llm = LLM(str(art), num_blocks=64, block_size=4)
    indexer = llm.engine.executor.runner.model.model.layers[1].self_attn.indexer
    assert indexer.wq_b.weight.dtype == torch.bfloat16 and indexer.wk.weight.is_floating_point()
    assert indexer.weights_proj.weight.dtype == torch.float32
    direct = LLM(str(v32_src), dtype="float32", num_blocks=64, block_size=4)
    ids = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(8)).tolist()
    cos = torch.nn.functional.cosine_similarity(
        full_logits(direct.engine, ids), full_logits(llm.engine, ids).float(), dim=-1
    )
    assert cos.min() > 0.95, cos
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 12
    assert_pool_clean(llm.engine)


def test_random_weights_with_the_mtp_layer_draft_and_verify(v32_src, tmp_path) -> None:  # noqa: ANN001
    """A V3.2 config with one MTP layer (random weights): the MTP layer is a sparse-attention
    layer too, with its own (latent, index keys) cache; MTP on gives MTP off's greedy tokens."""
    import json

    from dsinfer import LLM

    cfg = json.loads((v32_src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    common = dict(random_weights=True, dtype="float32", num_blocks=64, block_size=4)
    on = LLM(str(tmp_path / "config.json"), mtp=True, tokenizer=str(v32_src), **common)
    assert on.engine.executor.runner.model.mtp is not None
    assert len(on.engine.executor.runner.kv_caches) == cfg["num_hidden_layers"] + 1
    off = LLM(str(tmp_path / "config.json"), mtp=False, tokenizer=str(v32_src), **common)
    prompt = [{"prompt_token_ids": list(range(5, 25))}]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ours = on.generate(prompt, params)[0].outputs[0].token_ids
    assert ours == off.generate(prompt, params)[0].outputs[0].token_ids
    assert_pool_clean(on.engine)
