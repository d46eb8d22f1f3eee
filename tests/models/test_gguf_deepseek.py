"""DeepSeek-V2 / V2-Lite / V3 GGUF files (llama.cpp's `deepseek2`): tiny random checkpoints
written by transformers, converted as llama.cpp's converter converts them (tests/gguf_writer.py),
loaded by dsinfer against transformers on the original weights."""

from __future__ import annotations

import json

import gguf
import pytest
import torch

from dsinfer import LLM
from dsinfer.models.gguf_deepseek import hf_config
from dsinfer.models.gguf_reader import GGUFFile
from dsinfer.models.loader import read_model_config
from dsinfer.models.registry import config_from_hf
from tests.gguf_writer import write_deepseek2
from tests.helpers import DEEPSEEK_CASES as CASES
from tests.helpers import VOCAB, assert_logits_match, full_logits, tiny_gguf_deepseek


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    """(case, transformers model, its checkpoint directory, its F32 GGUF)."""
    model = tiny_gguf_deepseek(request.param)
    src = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(src)
    return request.param, model, src, write_deepseek2(src, src / "model.gguf")


def test_the_config_read_from_gguf_is_the_checkpoints(converted):
    """Every field the model is built from equals what config.json gives, except those the
    GGUF cannot hold (the checkpoint's dtype)."""
    _, _, src, path = converted
    want = config_from_hf(json.loads((src / "config.json").read_text()))
    got = read_model_config(path)
    assert got.architecture == want.architecture
    assert got.mla == want.mla and got.moe == want.moe and got.rope == want.rope
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
        assert getattr(got, field) == getattr(want, field), field
    assert (got.head_dim, got.tie_word_embeddings) == (want.head_dim, want.tie_word_embeddings)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_f32_gguf_logits_match_transformers(converted, backend):
    _, model, _, path = converted
    llm = LLM(str(path), backend=backend, dtype="float32", num_blocks=64, block_size=4)
    assert_logits_match(llm, model, (1, 9, 40), VOCAB, 1e-4)


@pytest.mark.parametrize(("qtype", "rows"), [("Q4_0", 32), ("Q4_1", 32), ("Q4_0", 64)])
def test_q4_gguf_packs_its_experts_as_they_are(qtype, rows, tmp_path):
    """A Q4 file on the direct int4 path: routed experts packed from the file's blocks (experts
    of 32 or 64 rows, which the int4 kernel takes: gate | up packed joined, or each whole
    64-row block apart), the rest float or int8 as planned; it computes what the same file
    computes dequantised to floats, within the kernels' bf16 arithmetic."""
    model = tiny_gguf_deepseek("v3", moe_intermediate_size=rows)
    model.save_pretrained(tmp_path)
    path = write_deepseek2(tmp_path, tmp_path / "q4.gguf", qtype=qtype)
    opts = dict(dtype="bfloat16", num_blocks=64, block_size=4)
    direct = LLM(str(path), quantization="auto", **opts)
    layers = direct.engine.executor.runner.model.model.layers
    assert all(hasattr(layer.mlp.experts, "q13") for layer in layers[1:])
    assert hasattr(layers[0].mlp.gate_up_proj, "qweight")  # the dense MLP: Q4 in the file
    ids = list(range(5, 30))
    got = full_logits(direct.engine, ids).float()
    del direct
    want = full_logits(LLM(str(path), quantization="none", **opts).engine, ids).float()
    # bf16 scales and activations: ~0.2% of the largest logit on average, a few % at worst
    # (measured; experts packed in the wrong order or with another's scales: ~10× that).
    err, top = (got - want).abs(), want.abs().max().item()
    assert err.mean().item() < 0.005 * top and err.max().item() < 0.1 * top, (err.mean(), top)
    assert got.argmax(-1).eq(want.argmax(-1)).float().mean().item() > 0.9


@pytest.mark.parametrize("rows", [32, 64])
def test_q4_experts_hold_the_files_weights_exactly(rows, tmp_path):
    """Every packed expert, widened, is the file's own dequantised weight up to the bf16
    rounding of its scale and zero (int4 runs with bf16 activations), gate rows before up."""
    from dsinfer.layers.int4_pack import int4pack_codes
    from dsinfer.models.loader import load_model

    tiny_gguf_deepseek("v3", moe_intermediate_size=rows).save_pretrained(tmp_path)
    path = str(write_deepseek2(tmp_path, tmp_path / "q4.gguf", qtype="Q4_1"))
    packed = load_model(path, dtype="bfloat16", quantization="int4").model.model.layers
    floats = load_model(path, dtype="float32", quantization="none").model.model.layers
    for a, b in zip(packed[1:], floats[1:], strict=True):
        for which in ("13", "2"):
            q, sz = getattr(a.mlp.experts, f"q{which}"), getattr(a.mlp.experts, f"sz{which}")
            want = getattr(b.mlp.experts, f"w{which}")  # [E, out, in]
            codes = int4pack_codes(q).float() - 8  # [E, out, in]
            e, out_f, in_f = codes.shape
            sz = sz.float().transpose(1, 2)  # [E, out, G, 2]
            got = codes.view(e, out_f, -1, 32) * sz[..., :1] + sz[..., 1:]
            # bf16 scale and zero: ≤ 2⁻⁸ of each, ~2e-4 here; the weights are ~0.02
            torch.testing.assert_close(got.view(e, out_f, in_f), want, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K_M"])
def test_experts_loaded_for_the_fused_backend_are_its_repacked_layout(qtype, tmp_path):
    """Loaded for the fused backend, a Q4 file's expert stacks are written in its int4 layout
    at once (Q4_1; the Q4_K_M mix's Q6_K stacks go through torch's layout and the repack):
    the bytes of loading torch's layout and repacking it, and a model so loaded refuses the
    reference kernels rather than misreading its stacks."""
    from dsinfer.layers.backend import apply_backend, fused_unavailable
    from dsinfer.models.loader import load_model

    cpu = torch.device("cpu")
    if fused_unavailable(cpu):
        pytest.skip(f"no fused backend here: {fused_unavailable(cpu)}")
    tiny_gguf_deepseek("v3", moe_intermediate_size=32).save_pretrained(tmp_path)
    path = str(write_deepseek2(tmp_path, tmp_path / "q4.gguf", qtype=qtype))
    opts = dict(dtype="bfloat16", quantization="int4")
    direct = load_model(path, backend="fused", **opts).model
    repacked = load_model(path, **opts).model
    direct_experts = [layer.mlp.experts for layer in direct.model.layers[1:]]
    if qtype == "Q4_1":
        assert all(e.method.vnni for e in direct_experts)  # before any use_kernels
    apply_backend(direct, "fused", cpu)
    apply_backend(repacked, "fused", cpu)
    for a, b in zip(direct_experts, repacked.model.layers[1:], strict=True):
        for name in a.method.tensor_names:
            assert torch.equal(getattr(a, name), getattr(b.mlp.experts, name)), name
    with pytest.raises(ValueError, match="fused backend's int4 layout"):
        apply_backend(direct, "reference", cpu)


def test_experts_the_file_keeps_float_are_quantised_after_loading(converted, tmp_path):
    """Experts of 24 rows: llama.cpp leaves the down stacks F32 (rows are not whole blocks),
    the int4 kernel does not take them either, so the stacks load float and end int8."""
    _, _, src, _ = converted
    path = write_deepseek2(src, tmp_path / "q4.gguf", qtype="Q4_0")
    llm = LLM(str(path), quantization="auto", dtype="bfloat16", num_blocks=64, block_size=4)
    experts = llm.engine.executor.runner.model.model.layers[1].mlp.experts
    assert type(experts.method).__name__ == "Int8ExpertsMethod"
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}])[0].outputs[0].token_ids


def test_legacy_files_with_kv_b_whole_load_the_same(converted, tmp_path):
    """Files converted before llama.cpp split kv_b (attn_kv_b kept whole, no *_mla lengths:
    key_length is nope + rope, value_length v) give the same config and logits."""
    _, model, _, path = converted
    legacy = tmp_path / "legacy.gguf"
    _rewrite_legacy(path, legacy, model.config)
    assert read_model_config(legacy) == read_model_config(path)
    llm = LLM(str(legacy), dtype="float32", num_blocks=64, block_size=4)
    assert_logits_match(llm, model, (9,), VOCAB, 1e-4)


def _rewrite_legacy(src, dst, hf) -> None:  # noqa: ANN001
    """src with k_b / v_b joined back into attn_kv_b and the metadata of older converters."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), "deepseek2")
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}
    for key, field in reader.fields.items():
        if key in skip or key.endswith(("key_length_mla", "value_length_mla")):
            continue
        value = field.contents()
        if key.endswith("attention.key_length"):
            value = hf.qk_nope_head_dim + hf.qk_rope_head_dim
        elif key.endswith("attention.value_length"):
            value = hf.v_head_dim
        elif key.endswith("attention.head_count_kv"):
            value = hf.num_attention_heads
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind not in ("attn_k_b", "attn_v_b"):
            writer.add_tensor(t.name, arr)
            continue
        block = t.name.split(".")[1]
        halves.setdefault(block, {})[kind] = torch.from_numpy(arr.copy())
        if len(halves[block]) == 2:
            pair = halves.pop(block)
            # k_b [H, rank, nope] → [H, nope, rank]; then v_b [H, v, rank]: kv_b as HF has it
            kv_b = torch.cat([pair["attn_k_b"].transpose(1, 2), pair["attn_v_b"]], dim=1)
            writer.add_tensor(f"blk.{block}.attn_kv_b.weight", kv_b.flatten(0, 1).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_gating_and_missing_halves_are_refused(converted):
    from dsinfer.models.gguf_deepseek import hf_tensors

    _, _, _, path = converted
    reader = GGUFFile(path)
    reader.fields["deepseek2.expert_gating_func"] = 3  # llama.cpp's sqrt-softplus: not DeepSeek
    with pytest.raises(ValueError, match="gating function 3"):
        hf_config(reader)
    del (
        reader.fields["deepseek2.expert_gating_func"],
        reader.fields["deepseek2.attention.kv_lora_rank"],
    )
    with pytest.raises(ValueError, match="lacks deepseek2.attention.kv_lora_rank"):
        hf_config(reader)
    only_k = [("blk.0.attn_k_b.weight", torch.zeros(4, 16, 16))]
    with pytest.raises(ValueError, match=r"layers \['0'\] lack attn_k_b or attn_v_b"):
        list(hf_tensors(only_k, lambda n: n))


def test_an_int4_artifact_compiled_from_a_q4_file_keeps_its_blocks(tmp_path):
    """`dsinfer compile FILE.gguf --quant int4` of a Q4_0 file packs its blocks as the direct
    load does (no fp32 copy, no second quantisation): the artifact computes exactly what the
    file computes, and a layer the file kept F32 (rows not whole blocks) is planned as usual."""
    from dsinfer.artifact.compiler import CompileOptions, compile_artifact

    tiny_gguf_deepseek("v3", moe_intermediate_size=32).save_pretrained(tmp_path)
    path = write_deepseek2(tmp_path, tmp_path / "q4.gguf", qtype="Q4_0")
    manifest = compile_artifact(str(path), tmp_path / "art", CompileOptions(quant="int4"))
    assert manifest.quantization["layer_formats"]["lm_head"] == "int8"
    opts = dict(num_blocks=64, block_size=4)
    ids = list(range(5, 30))
    want = full_logits(LLM(str(path), **opts).engine, ids)
    got = full_logits(LLM(str(tmp_path / "art"), **opts).engine, ids)
    assert torch.equal(got, want)


def test_a_load_beyond_the_machines_memory_is_refused_up_front(converted, monkeypatch):
    """A file that would load as floats (here F32) larger than the memory available is
    refused before any weight is read, with the way to load it quantised; quantised as it
    loads (layer by layer, never the whole float model) the same file and its checkpoint fit
    in that memory, and everything loads when the memory is there."""
    from dsinfer.models import loader

    _, _, src, path = converted

    def size(model) -> int:  # noqa: ANN001
        return sum(p.numel() * p.element_size() for p in model.parameters())

    floats = size(loader.load_model(str(path), dtype="float32").model)
    int8 = size(loader.load_model(str(path), dtype="bfloat16", quantization="int8").model)
    assert int8 < 0.6 * floats
    monkeypatch.setattr(loader, "available_bytes", lambda: int(0.75 * floats))
    for source in (path, src):  # the GGUF, the HF checkpoint
        with pytest.raises(ValueError, match=r"more than the .* available; quantise them as"):
            loader.load_model(str(source), dtype="float32")
        quantised = loader.load_model(str(source), dtype="bfloat16", quantization="int8")
        assert size(quantised.model) == int8
    monkeypatch.setattr(loader, "available_bytes", lambda: 2**10)
    with pytest.raises(ValueError, match=r"as int8 take .* \(\+0\.0 GiB while loading\)"):
        loader.load_model(str(path), dtype="bfloat16", quantization="int8")
