"""One stream's decode steps under torch.profiler: where a token's time goes.

  python benchmarks/profile_decode.py [--tokens 32] [--streams 1] [--dtype auto] [--backend auto]

Loads the embedded model as `make serve` does (or as the flags say), warms up, times 128-token
greedy decodes of `--streams` prompts at once, then profiles one 32-token decode and prints the
operator table. With several streams the timing covers the prompts' prefill too; the profile
starts after it (the prompts are decoded one step first), so that its table is the decode's."""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dsinfer import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--backend", default="auto")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--streams", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(2)
    llm = LLM(args.model, dtype=args.dtype, backend=args.backend)
    greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    # Distinct prompts, so that a prefix-cache hit does not stand in for the prefill.
    prompts = [f"Tell me story number {i} about a dragon." for i in range(args.streams)]
    llm.generate(prompts, greedy)
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompts, greedy)
        dt = time.perf_counter() - t0
        n = 128 * len(prompts)
        print(f"{len(prompts)} stream(s): {n / dt:.1f} tok/s ({1e3 * dt / 128:.2f} ms a step)")
    short = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, short)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
