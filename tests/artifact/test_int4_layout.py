"""torch packs int4 weights by its CPU capability (64-row blocks on AVX-512, others on AVX2 and
scalar builds): an int4 artifact compiled here must give the same answers in a process whose
torch packs otherwise (ATEN_CPU_CAPABILITY=avx2 on this machine), its tensors converted at load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsinfer.artifact.compiler import CompileOptions, compile_artifact
from dsinfer.artifact.manifest import read_manifest
from tests.helpers import write_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys
from dsinfer import LLM
from dsinfer.layers.int4_pack import int4_pack_layout
from tests.helpers import full_logits
llm = LLM(sys.argv[1], backend="reference", num_blocks=16, block_size=4)
logits = full_logits(llm.engine, [1, 5, 9, 33, 7, 120])
print(json.dumps({"layout": int4_pack_layout(), "logits": logits.float().tolist()}))
"""


def _serve(art: Path, capability: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(art)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_int4_artifact_gives_the_same_logits_where_torch_packs_otherwise(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dsinfer.layers.int4_pack import BLOCKS64, int4_pack_layout

    if int4_pack_layout() != BLOCKS64:
        # An AVX2 CPU cannot run torch's AVX-512 kernels; the conversion itself is tested on
        # every machine (tests/layers/test_quant.py, both layouts).
        pytest.skip("this CPU packs torch-cpu-avx2 only: no second layout to serve in")

    torch.manual_seed(12)
    cfg = LlamaConfig(  # every int4 layer's rows a multiple of 64 (whole blocks)
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    write_tiny_tokenizer(tmp_path / "src")
    compile_artifact(str(tmp_path / "src"), tmp_path / "art", CompileOptions(quant="int4"))
    assert read_manifest(tmp_path / "art").quantization["int4_layout"] == "torch-cpu-blocks64"
    here, avx2 = _serve(tmp_path / "art", None), _serve(tmp_path / "art", "avx2")
    assert here["layout"] == "torch-cpu-blocks64" and avx2["layout"] == "torch-cpu-avx2"
    a, b = torch.tensor(here["logits"]), torch.tensor(avx2["logits"])
    # The same weights through another build of torch's kernel (bf16 accumulation order); the
    # bytes read unconverted gave other weights (a relative error of ~1.5).
    assert ((a - b).norm() / a.norm()).item() < 2e-2, (a - b).abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
