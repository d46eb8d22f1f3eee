"""K-quant GGUFs (Q4_K_M, the file most users download) and quantisation as weights load.

A Q4_K super-block is 8 groups of 32, each with its own scale and minimum: our int4 groups,
so its codes are packed as they are. A Q4_K_M file mixes Q4_K with Q6_K (and, for rows that
are not whole super-blocks, Q5_0 / Q8_0): under `--quantization auto` those layers keep 8
bits (int8), under `int4` they become int4. The files are written as llama-quantize writes
them (tests/gguf_writer.py); the gguf package's own dequantiser is the reference.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from dsinfer import LLM
from dsinfer.layers.int4_pack import int4pack_codes
from dsinfer.models.gguf_file import _fast_dequantize, native_scheme, open_gguf
from dsinfer.models.gguf_int4 import q4_blocks
from dsinfer.models.loader import load_model
from tests.gguf_writer import quantize, tensor_arrays, write_deepseek2
from tests.helpers import full_logits, tiny_gguf_deepseek, tiny_llama_dir

# Rows of whole super-blocks (256) in every expert and dense MLP; four layers, so that
# Q4_K_M's `use_more_bits` gives some layers Q6_K down projections (blocks 2 and 3) and not
# others.
KQ_SHAPE = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=512)
KQ_LAYERS = 4


def _reference(blocks: np.ndarray, qname: str) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qname]))


@pytest.mark.parametrize("qname", ["Q4_K", "Q6_K"])
def test_the_writers_k_quants_are_what_the_gguf_package_reads(qname):
    """Our test writer's blocks, read by the gguf package, give the weights back within the
    type's step (a wrong bit layout would give noise)."""
    x = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32) * 0.05
    got = _reference(quantize(x, qname), qname).reshape(6, 512)
    step = {"Q4_K": 0.4 / 15, "Q6_K": 0.2 / 31}[qname]  # ~range / codes of a group
    assert np.abs(got - x).max() < step


def test_q4_k_blocks_are_our_int4_groups_exactly():
    """x = (q − 8)·scale + zero per group of 32 reproduces the gguf package's Q4_K
    dequantisation (fp32); the fast dequantiser is bit for bit the package's."""
    x = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32) * 0.05
    x[:, :32] += 0.3  # a group whose minimum is above 0 (its stored minimum is then 0)
    blocks = quantize(x, "Q4_K")
    want = torch.from_numpy(_reference(blocks, "Q4_K").reshape(6, 512).copy())
    q, scale, zero = q4_blocks(blocks.reshape(-1), "Q4_K", rows=6)
    got = (q.float() - 8).view(6, 16, 32) * scale[..., None] + zero[..., None]
    torch.testing.assert_close(got.view(6, 512), want, atol=1e-6, rtol=1e-6)
    fast = _fast_dequantize(blocks.reshape(-1), "Q4_K")
    assert fast is not None and torch.equal(fast.view(6, 512), want)


@pytest.mark.parametrize("qname", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0"])
def test_the_one_pass_block_decoder_is_torchs_passes_bit_for_bit(qname):
    """The fused kernels' GGUF decoder (gguf_int4_groups, the direct load's: ~10x faster)
    gives the codes, scales and zeros of torch's passes exactly: the 4-bit types' blocks as
    they are (q4_blocks), Q5_0 and Q8_0 values quantised by int4_codes, as compile would.
    Rows with a constant group (step clamped to 1e-12) and ties at half a step included."""
    from dsinfer.layers.kernels.cpu_build import load_cpu_ops
    from dsinfer.layers.quant import int4_codes
    from dsinfer.models.gguf_file import block_values, file_bytes
    from dsinfer.models.gguf_int4 import int4_groups

    if load_cpu_ops() is not None:
        pytest.skip("the fused CPU kernels do not build here: the torch passes are the path")
    rows, k = 5, 512
    x = np.random.default_rng(2).standard_normal((rows, k)).astype(np.float32) * 0.05
    x[0, :32] = 0.25  # a constant group
    x[1, 32:64] = np.arange(32) % 3 * 0.125  # values that land between codes
    x[:, 64:96] += 0.3  # a group whose minimum is above 0
    blocks = quantize(x, qname).reshape(-1)
    kind = gguf.GGMLQuantizationType[qname]
    raw = file_bytes(blocks)
    got = torch.ops.dsinfer.gguf_int4_groups(raw, list(_KERNEL_TYPES).index(qname), rows, k)
    if qname in ("Q4_0", "Q4_1", "Q4_K"):
        want = q4_blocks(blocks, qname, rows)
    else:
        want = int4_codes(block_values(blocks, kind).view(rows, k), 32)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(
        torch.equal(a, b) for a, b in zip(int4_groups(blocks, kind, rows, k), want, strict=True)
    )
    with pytest.raises(RuntimeError, match="bytes for"):
        torch.ops.dsinfer.gguf_int4_groups(raw[:-1].contiguous(), 0, rows, k)


_KERNEL_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0")  # gguf_int4_groups' type numbers


@pytest.mark.parametrize("qname", _KERNEL_TYPES)
def test_the_fused_layout_is_written_from_the_blocks_as_the_repack_writes_it(qname):
    """gguf_int4_vnni_into (the direct load of expert stacks for the fused backend) writes the
    bytes that the path it replaces ends with: gguf_int4_groups → torch's int4pack → bf16
    scale | zero pairs → int4_vnni_pack. Into a slice of a larger stack (the up rows after the
    gate's), leaving the rest untouched; wrong shapes are refused."""
    from dsinfer.layers.int4_pack import int4_block_rows, int4pack_from_codes
    from dsinfer.layers.kernels.cpu_build import load_cpu_ops
    from dsinfer.layers.quant import int4_pairs
    from dsinfer.models.gguf_file import file_bytes

    if load_cpu_ops() is not None or int4_block_rows() is None:
        pytest.skip("the fused CPU kernels do not build here: nothing is repacked")
    rows, k = 64, 512
    x = np.random.default_rng(3).standard_normal((rows, k)).astype(np.float32) * 0.05
    x[2, :32] = 0.25  # a constant group
    x[:, 64:96] += 0.3  # groups whose minimum is above 0
    raw = file_bytes(quantize(x, qname).reshape(-1))
    code = _KERNEL_TYPES.index(qname)
    q, scale, zero = torch.ops.dsinfer.gguf_int4_groups(raw, code, rows, k)
    pairs = int4_pairs(scale, zero, torch.bfloat16)
    want = torch.ops.dsinfer.int4_vnni_pack(int4pack_from_codes(q), 32, pairs, int4_block_rows())
    codes = torch.full((rows // 16 + 2, k // 8, 64), 7, dtype=torch.uint8)
    sz = torch.full((rows // 16 + 2, k // 32, 2, 16), 3.0, dtype=torch.bfloat16)
    torch.ops.dsinfer.gguf_int4_vnni_into(raw, code, rows, k, codes[2:], sz[2:])
    assert torch.equal(codes[2:], want[0]) and torch.equal(sz[2:], want[1])
    assert codes[:2].eq(7).all() and sz[:2].eq(3.0).all()
    with pytest.raises(RuntimeError, match="a multiple of 16"):
        torch.ops.dsinfer.gguf_int4_vnni_into(
            raw[: raw.numel() // 2], code, rows // 2 - 8, k, codes, sz
        )
    with pytest.raises(RuntimeError, match="codes"):
        torch.ops.dsinfer.gguf_int4_vnni_into(raw, code, rows, k, codes, sz)


def test_a_file_with_any_4_bit_projection_is_int4():
    """The scheme a file loads under by default: int4 when any projection is 4-bit (SmolLM2's
    Q4_K_M is mostly Q5_0, its Q4_K layers still load as they are), int8 when the quantised
    ones are all wider, none when all are float; the embedding, the head and the routers do
    not count."""
    from types import SimpleNamespace

    from dsinfer.models.gguf_reader import GGUFTensor

    def reader(*types: tuple[str, str]) -> SimpleNamespace:
        kinds = gguf.GGMLQuantizationType
        return SimpleNamespace(
            tensors=[GGUFTensor(n, (576, 576), kinds[q], np.zeros(0, np.uint8)) for n, q in types]
        )

    q5 = [(f"blk.{i}.attn_q.weight", "Q5_0") for i in range(8)]
    assert native_scheme(reader(*q5, ("blk.0.ffn_down.weight", "Q4_K"))) == "int4"
    assert native_scheme(reader(*q5, ("blk.0.ffn_down.weight", "Q6_K"))) == "int8"
    assert native_scheme(reader(("blk.0.attn_q.weight", "F16"))) == "none"
    ignored = [("token_embd.weight", "Q4_K"), ("output.weight", "Q4_0")]
    assert native_scheme(reader(*ignored, ("blk.0.ffn_gate_inp.weight", "Q4_0"))) == "none"


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint and its Q4_K_M GGUF."""
    src = tmp_path_factory.mktemp("q4km")
    tiny_gguf_deepseek("v3", num_hidden_layers=KQ_LAYERS, **KQ_SHAPE).save_pretrained(src)
    return src, write_deepseek2(src, src / "q4_k_m.gguf", qtype="Q4_K_M")


def _types(path) -> dict[str, str]:  # noqa: ANN001
    return {t.name: t.tensor_type.name for t in open_gguf(path).tensors}


def test_a_q4_k_m_file_is_int4_and_keeps_its_wider_layers_in_8_bits(q4_k_m):
    """The file's layers as llama-quantize chose them; under auto each 4-bit layer is int4
    from its blocks and each Q6_K layer int8; under int4 everything takes int4 (the LM head
    keeps 8 bits, as from any checkpoint)."""
    _, path = q4_k_m
    types = _types(path)
    assert (
        types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.2.ffn_down_shexp.weight"] == "Q6_K"
    )
    assert types["blk.2.ffn_down_exps.weight"] == "Q6_K" and types["output.weight"] == "Q6_K"
    assert native_scheme(open_gguf(path)) == "int4"

    def methods(quantization: str) -> dict[str, str]:
        layers = load_model(str(path), quantization=quantization).model.model.layers
        return {
            "dense down": type(layers[0].mlp.down_proj.method).__name__,
            "shared down (Q4_K)": type(layers[1].mlp.shared_experts.down_proj.method).__name__,
            "shared down (Q6_K)": type(layers[2].mlp.shared_experts.down_proj.method).__name__,
            "experts (Q6_K down)": type(layers[2].mlp.experts.method).__name__,
        }

    assert methods("auto") == {
        "dense down": "Int4LinearMethod",
        "shared down (Q4_K)": "Int4LinearMethod",
        "shared down (Q6_K)": "Int8LinearMethod",
        "experts (Q6_K down)": "Int4ExpertsMethod",
    }
    assert set(methods("int4").values()) == {"Int4LinearMethod", "Int4ExpertsMethod"}


def _widened(q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """An int4 expert stack q [E, out, in / 2], sz [E, G, out, 2] → float [E, out, in]."""
    codes = int4pack_codes(q).float() - 8
    e, out_f, in_f = codes.shape
    sz = sz.float().transpose(1, 2)  # [E, out, G, 2]
    return (codes.view(e, out_f, -1, 32) * sz[..., :1] + sz[..., 1:]).view(e, out_f, in_f)


def test_q4_k_experts_hold_the_files_weights_and_q6_k_ones_our_int4(q4_k_m):
    """Every Q4_K expert stack, widened, is the file's dequantised stack up to the bf16
    rounding of its scales and zeros; a Q6_K down stack is what our int4 quantiser makes of
    the file's values (the one format of a stack is int4: a step of ~range / 15)."""
    from dsinfer.layers.quant import int4_codes

    _, path = q4_k_m
    packed = load_model(str(path), quantization="auto").model.model.layers
    file = {k: torch.from_numpy(v) for k, v in tensor_arrays(path).items()}  # the gguf package's
    types = _types(path)
    for i in range(1, KQ_LAYERS):
        a = packed[i].mlp.experts
        gate, up, down = (file[f"blk.{i}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
        torch.testing.assert_close(
            _widened(a.q13, a.sz13), torch.cat([gate, up], dim=1), atol=1e-3, rtol=1e-2
        )
        got2 = _widened(a.q2, a.sz2)
        if types[f"blk.{i}.ffn_down_exps.weight"] == "Q4_K":
            torch.testing.assert_close(got2, down, atol=1e-3, rtol=1e-2)
            continue
        codes = torch.stack([int4_codes(w, 32)[0] for w in down])
        assert torch.equal(int4pack_codes(a.q2), codes), i
        step = (down.amax() - down.amin()).item() / 15
        assert (got2 - down).abs().max().item() < step


def test_a_q4_k_file_computes_what_it_holds(tmp_path):
    """The direct int4 load of a Q4_K file against the same file dequantised to floats:
    within the kernels' bf16 arithmetic, the same greedy tokens almost everywhere."""
    tiny_gguf_deepseek("v3", num_hidden_layers=KQ_LAYERS, **KQ_SHAPE).save_pretrained(tmp_path)
    path = write_deepseek2(tmp_path, tmp_path / "q4_k.gguf", qtype="Q4_K")
    # Exact activations: the load is under test, not the int8 rounding of the default (which
    # moves this random model's many near-ties: 88% of its greedy tokens agree with it).
    opts = dict(dtype="bfloat16", num_blocks=64, block_size=4, int8_activations="none")
    ids = list(range(5, 30))
    direct = LLM(str(path), quantization="auto", **opts)
    assert hasattr(direct.engine.executor.runner.model.model.layers[1].mlp.experts, "q13")
    got = full_logits(direct.engine, ids).float()
    del direct
    want = full_logits(LLM(str(path), quantization="none", **opts).engine, ids).float()
    # bf16 scales, zeros and activations: ~0.8% of the largest logit on average (measured;
    # groups in the wrong order or minima of the wrong sign: logits of another model).
    err, top = (got - want).abs(), want.abs().max().item()
    assert err.mean().item() < 0.015 * top, (err.mean(), top)
    assert got.argmax(-1).eq(want.argmax(-1)).float().mean().item() > 0.9


def test_an_int4_artifact_of_a_q4_k_m_file_is_the_direct_int4_load(q4_k_m, tmp_path):
    """`dsinfer compile --quant int4` of a Q4_K_M file packs its Q4_K blocks as they are and
    quantises the rest as `--quantization int4` does: the artifact computes exactly what that
    load computes, and its manifest lists the formats the model holds."""
    from dsinfer.artifact.compiler import CompileOptions, compile_artifact

    _, path = q4_k_m
    manifest = compile_artifact(str(path), tmp_path / "art", CompileOptions(quant="int4"))
    assert manifest.quantization["layer_formats"]["lm_head"] == "int8"
    assert (
        "model.layers.2.mlp.shared_experts.down_proj" not in manifest.quantization["layer_formats"]
    )
    opts = dict(num_blocks=64, block_size=4)
    ids = list(range(5, 30))
    want = full_logits(LLM(str(path), quantization="int4", **opts).engine, ids)
    got = full_logits(LLM(str(tmp_path / "art"), **opts).engine, ids)
    assert torch.equal(got, want)


def test_each_layer_is_quantised_as_soon_as_its_weights_are_in(tmp_path, monkeypatch):
    """A float checkpoint loaded with --quantization int8: each layer is quantised right after
    its last tensor is read, before the next one is (the process never holds more than one
    layer's floats beside the quantised ones), and the result is the whole-model
    quantisation's, tensor for tensor."""
    from dsinfer.layers import quant
    from dsinfer.models import loader

    src = tiny_llama_dir(tmp_path, num_layers=3)
    events: list[tuple[str, object]] = []
    read, apply = loader.iter_safetensors, quant.apply_format

    def reading(path):  # noqa: ANN001, ANN202
        for name, w in read(path):
            events.append(("read", name))
            yield name, w

    def quantising(layer, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        events.append(("quantise", layer))
        return apply(layer, *args, **kwargs)

    monkeypatch.setattr(loader, "iter_safetensors", reading)
    monkeypatch.setattr(quant, "apply_format", quantising)
    streamed = load_model(str(src), dtype="bfloat16", quantization="int8").model
    names = {id(m): n for n, m in streamed.named_modules()}
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
    fused |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    parts = {"qkv_proj": 3, "gate_up_proj": 2}
    seen: dict[str, int] = {}
    quantised = []
    for i, (kind, what) in enumerate(events):
        if kind == "quantise":
            quantised.append(names[id(what)])
            continue
        module, dot, leaf = str(what).removesuffix(".weight").rpartition(".")
        layer = f"{module}{dot}{fused.get(leaf, leaf)}"
        if layer not in {names[id(m)] for m in streamed.modules() if hasattr(m, "method")}:
            continue  # norms, the embedding
        seen[layer] = seen.get(layer, 0) + 1
        if seen[layer] == parts.get(layer.rpartition(".")[2], 1):  # filled: quantised next
            assert events[i + 1][0] == "quantise" and names[id(events[i + 1][1])] == layer
    assert len(quantised) == 3 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    monkeypatch.setattr(quant, "apply_format", apply)
    whole = load_model(str(src), dtype="bfloat16").model
    quant.quantize_model(whole, "int8", 32, torch.bfloat16)
    a, b = streamed.state_dict(), whole.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
