"""What constrained decoding adds to a decode step at batch 16 (issue target: ≤ 10%).

  python benchmarks/structured_overhead.py [--batch 16] [--tokens 48] [--rounds 3]

The embedded model as `make serve` loads it. Each round runs the same 16 prompts twice, one
after the other: unconstrained, then every request under a JSON schema (a long string field,
so no request ends early), and times the engine steps in which all 16 requests decode. The
ratio of the median step times is the grammar's cost: bitmask fill (on a helper thread,
during the forward), unpacking, masking and the matcher's accept.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dsinfer import LLM, SamplingParams
from dsinfer.structured import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400, "maxLength": 2000}},
    "required": ["story"],
}


def step_times(llm: LLM, prompts: list[str], params: SamplingParams) -> list[float]:
    """Seconds of each engine step in which every request decoded one token."""
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, params)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if len(outs) == len(prompts) and all(len(o.outputs[0].delta_token_ids) == 1 for o in outs):
            times.append(dt)
    return times[1:]  # the first such step may still carry prefill work


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(2)
    llm = LLM("smollm2")
    prompts = [f"Write story number {i} about a lighthouse keeper." for i in range(args.batch)]
    free = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.tokens, temperature=0.0, structured=StructuredOutputs.from_schema(SCHEMA)
    )
    step_times(llm, prompts[:2], free)  # warm-up: kernels, first grammar compile
    step_times(llm, prompts[:2], constrained)
    ratios = []
    for r in range(args.rounds):
        a = statistics.median(step_times(llm, prompts, free))
        b = statistics.median(step_times(llm, prompts, constrained))
        ratios.append(b / a)
        print(
            f"round {r + 1}: batch {args.batch} decode step {1e3 * a:.1f} ms free, "
            f"{1e3 * b:.1f} ms constrained: +{100 * (b / a - 1):.1f}%"
        )
    print(f"median overhead: +{100 * (statistics.median(ratios) - 1):.1f}% (target ≤ 10%)")


if __name__ == "__main__":
    main()
