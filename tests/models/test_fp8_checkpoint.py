"""Block-FP8 checkpoints (DeepSeek's own releases of V3 / R1 / V3.2): a tiny V3 written by
transformers, its projections quantised to float8 e4m3 in blocks with `weight_scale_inv`
beside them as DeepSeek stores them, loads with the very weights the scales give back: the
same logits as the checkpoint holding those widened weights in fp32, and the same artifact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsinfer import LLM
from dsinfer.models.fp8_checkpoint import dequantize_blocks
from tests.helpers import DEEPSEEK_CASES as CASES
from tests.helpers import DEEPSEEK_COMMON as COMMON
from tests.helpers import full_logits, write_tiny_tokenizer

BLOCK = (16, 16)  # DeepSeek's are 128 × 128; 16 gives this tiny model whole and partial blocks


def _quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] fp32 → (float8 e4m3 [O, I], scales [⌈O/16⌉, ⌈I/16⌉]) with w ≈ q · s per block."""
    rows, cols = BLOCK
    o, i = w.shape
    s = torch.empty(-(-o // rows), -(-i // cols))
    q = torch.empty(o, i, dtype=torch.float8_e4m3fn)
    for a in range(s.shape[0]):
        for b in range(s.shape[1]):
            block = w[a * rows : (a + 1) * rows, b * cols : (b + 1) * cols]
            s[a, b] = block.abs().max().clamp(min=1e-12) / 448.0
            q[a * rows : (a + 1) * rows, b * cols : (b + 1) * cols] = (block / s[a, b]).to(
                torch.float8_e4m3fn
            )
    return q, s


def _is_projection(name: str) -> bool:
    """What DeepSeek stores in FP8: the layers' projections and experts (not the embedding,
    the norms, the router or the LM head)."""
    return name.startswith("model.layers.") and name.endswith("proj.weight")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):  # noqa: ANN201
    """(FP8 checkpoint, the same weights widened back to fp32) as two directories."""
    transformers = pytest.importorskip("transformers")
    src = tmp_path_factory.mktemp("v3")
    torch.manual_seed(11)
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**COMMON, **CASES["v3"][1])
    )
    model.save_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    fp8, widened = {}, {}
    for name, t in tensors.items():
        if _is_projection(name):
            q, s = _quantise(t.float())
            fp8[name], fp8[name + "_scale_inv"] = q, s
            widened[name] = dequantize_blocks(q, s, BLOCK)
        else:
            fp8[name] = widened[name] = t
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) > 20
    config = json.loads((src / "config.json").read_text())
    dirs = {}
    for kind, weights in (("fp8", fp8), ("widened", widened)):
        d = tmp_path_factory.mktemp(kind)
        # Two shards, a weight and its scales in different files: the loader finds them by name.
        names = sorted(weights)
        half = len(names) // 2
        shards = {"model-1.safetensors": names[:half], "model-2.safetensors": names[half:]}
        for fname, part in shards.items():
            save_file({n: weights[n].contiguous() for n in part}, d / fname)
        index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        cfg = dict(config)
        if kind == "fp8":
            cfg["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(BLOCK),
            }
        (d / "config.json").write_text(json.dumps(cfg))
        write_tiny_tokenizer(d)
        dirs[kind] = d
    return dirs


def test_dequantize_blocks_covers_partial_blocks() -> None:
    q = torch.full((20, 40), 2.0).to(torch.float8_e4m3fn)
    s = torch.arange(1.0, 7.0).view(2, 3)
    w = dequantize_blocks(q, s, BLOCK)
    assert w[0, 0] == 2.0 and w[15, 15] == 2.0 and w[16, 0] == 8.0 and w[19, 39] == 12.0
    with pytest.raises(ValueError, match="do not cover"):
        dequantize_blocks(q, s[:1], BLOCK)


def test_an_fp8_checkpoint_loads_as_its_widened_weights(checkpoints) -> None:  # noqa: ANN001
    options = dict(dtype="float32", num_blocks=64, block_size=4)
    fp8, widened = (
        LLM(str(checkpoints["fp8"]), **options),
        LLM(str(checkpoints["widened"]), **options),
    )
    ids = [1, 5, 9, 33, 200, 7, 3, 99, 41, 17]
    torch.testing.assert_close(
        full_logits(fp8.engine, ids), full_logits(widened.engine, ids), rtol=0, atol=0
    )
    # bf16 (`auto` follows config.json's dtype) and a compiled int8 artifact read it too.
    auto = LLM(str(checkpoints["fp8"]), num_blocks=64, block_size=4)
    assert auto.engine.dtype == torch.float32  # transformers wrote float32 here
    from dsinfer.artifact.compiler import CompileOptions, compile_artifact

    art = checkpoints["fp8"].parent / "fp8-int8-artifact"
    compile_artifact(str(checkpoints["fp8"]), art, CompileOptions(quant="int8"))
    compiled = LLM(str(art), num_blocks=64, block_size=4)
    cos = torch.nn.functional.cosine_similarity(
        full_logits(widened.engine, ids), full_logits(compiled.engine, ids).float(), dim=-1
    )
    assert cos.min() > 0.99, cos


def test_other_quantised_checkpoints_are_refused_by_name(checkpoints, tmp_path) -> None:  # noqa: ANN001
    import shutil

    d = tmp_path / "gptq"
    shutil.copytree(checkpoints["widened"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantised with 'gptq'.*float \\(bf16\\) release"):
        LLM(str(d), dtype="float32", num_blocks=16, block_size=4)


def test_a_missing_scale_is_named(checkpoints, tmp_path) -> None:  # noqa: ANN001
    import shutil

    d = tmp_path / "noscale"
    shutil.copytree(checkpoints["fp8"], d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = next(n for n in index["weight_map"] if n.endswith("o_proj.weight_scale_inv"))
    fname = index["weight_map"].pop(victim)
    part = load_file(d / fname)
    part.pop(victim)
    save_file(part, d / fname)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    weight = victim.removesuffix("_scale_inv")
    with pytest.raises(ValueError, match=f"{weight} is FP8 but the checkpoint has no"):
        LLM(str(d), dtype="float32", num_blocks=16, block_size=4)
