"""One stream's decode steps under torch.profiler: where a token's time goes.

  python benchmarks/profile_decode.py [--tokens 32] [--dtype auto] [--backend auto]

Loads the embedded model as `make serve` does (or as the flags say), warms up, times 128-token
greedy decodes, then profiles one 32-token decode and prints the operator table."""

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
    args = p.parse_args()
    torch.set_num_threads(2)
    llm = LLM(args.model, dtype=args.dtype, backend=args.backend)
    greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    prompt = "Tell me a story about a dragon."
    llm.generate([prompt], greedy)
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate([prompt], greedy)
        dt = time.perf_counter() - t0
        print(f"one stream: {128 / dt:.1f} tok/s ({1e3 * dt / 128:.2f} ms a token)")
    short = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([prompt], short)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
