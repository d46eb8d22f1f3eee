"""Two busy engines in one process (two models, or a canary's two versions): the cores shared
between them (device/host_threads.CoreShare) against each taking every core, and one engine
alone, in one run on the embedded SmolLM2 as `make serve` configures it.

    python benchmarks/two_engines.py [--streams 1 16] [--rounds 3] [--max-tokens 96]

Each engine generates `streams` greedy requests on a thread of its own, both at once; the
three ways alternate within each round (these machines drift by 25% over minutes) and the
best round of each is kept. Prints output tokens a second over both engines, the ratios, and
whether every way gave the same tokens as the engine alone.
"""

from __future__ import annotations

import argparse
import threading
import time

from dsinfer import LLM, SamplingParams
from dsinfer.device.host_threads import core_share


def run_together(llms: list[LLM], prompts: list[dict], params: SamplingParams) -> tuple:
    """(output tok/s over every engine, each engine's token ids) with each on its own thread."""
    tokens: dict[int, list] = {}

    def generate(i: int) -> None:
        tokens[i] = [o.outputs[0].token_ids for o in llms[i].generate(prompts, params)]

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(llms))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    total = sum(len(ids) for out in tokens.values() for ids in out)
    return total / wall, [tokens[i] for i in range(len(llms))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    a, b = LLM("smollm2"), LLM("smollm2")
    share = core_share()
    print(f"cores shared: {share.cores}")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for streams in args.streams:
        prompts = [
            {"prompt_token_ids": [1, 504, 3458, 282] + [100 + i] * 8} for i in range(streams)
        ]
        for llm in (a, b):  # warm: the step program's buckets, the allocator
            llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        best = {"alone": 0.0, "shared": 0.0, "every core each": 0.0}
        alone_ids = None
        same = True
        for _ in range(args.rounds):
            rate, ids = run_together([a], prompts, params)
            best["alone"] = max(best["alone"], rate)
            alone_ids = alone_ids or ids[0]
            for way, enabled in (("shared", True), ("every core each", False)):
                share.enabled = enabled
                try:
                    rate, ids = run_together([a, b], prompts, params)
                finally:
                    share.enabled = True
                best[way] = max(best[way], rate)
                same = same and all(i == alone_ids for i in ids)
        print(
            f"{streams} stream(s) an engine, output tok/s over both engines: "
            + ", ".join(f"{k} {v:.1f}" for k, v in best.items())
            + f"; shared / every core each {best['shared'] / best['every core each']:.2f}x, "
            f"shared / alone {best['shared'] / best['alone']:.2f}x; "
            f"tokens the same as alone: {same}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
