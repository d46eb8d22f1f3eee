"""Where one engine step's time goes, phase by phase, in process.

  python benchmarks/step_phases.py [--tokens 512] [--streams 1] [--runs 3] [--malloc-arenas N]

Times `--streams` greedy streams of `--tokens` tokens each, started together (`LLM.generate`, the
embedded model as `make serve` loads it; with several streams their prefill counts too) and the
engine step's phases inside it: scheduling, the input build, the forward,
the logits, sampling, the scheduler's update and detokenising, as milliseconds a step. The
phases are timed by wrapping the methods that run them (no profiler: its own cost per op
would swamp a 2 ms step). `--malloc-arenas N` bounds glibc's arenas first, as `dsinfer serve`
does (`limit_malloc_arenas`; 0 = the server's bound, one a forward thread and two more)."""

from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

PHASES = ("step", "schedule", "build_input", "forward", "logits", "sample", "update", "process")


def _timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        totals[name + " calls"] += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--malloc-arenas", type=int, default=None)
    args = p.parse_args()
    if args.malloc_arenas is not None:
        from dsinfer.device.host_memory import limit_malloc_arenas

        limit_malloc_arenas(args.malloc_arenas or None)

    import dsinfer.engine.llm_engine as llm_engine
    import dsinfer.engine.scheduler as scheduler
    import dsinfer.worker.model_runner as model_runner
    from dsinfer import LLM, SamplingParams

    totals: dict[str, float] = collections.defaultdict(float)
    runner = model_runner.ModelRunner
    for owner, attr, name in (
        (llm_engine.LLMEngine, "step", "step"),
        (scheduler.Scheduler, "schedule", "schedule"),
        (model_runner, "build_model_input", "build_input"),
        (runner, "_forward", "forward"),
        (runner, "_logits", "logits"),
        (runner, "_sample", "sample"),
        (scheduler.Scheduler, "update", "update"),
        (llm_engine.LLMEngine, "_process", "process"),
    ):
        setattr(owner, attr, _timed(totals, name, getattr(owner, attr)))

    llm = LLM(args.model)
    prompts = [
        f"Write a long story ({i}) about a dragon who lives in a castle near the sea."
        for i in range(args.streams)
    ]
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, greedy, use_tqdm=False)  # warm-up
    for _ in range(args.runs):
        totals.clear()
        t0 = time.perf_counter()
        llm.generate(prompts, greedy, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = totals["step calls"]
        phases = " ".join(f"{k} {1e3 * totals[k] / steps:.3f}" for k in PHASES)
        print(
            f"{1e3 * wall / args.tokens:.3f} ms a token a stream, "
            f"{args.streams * args.tokens / wall:.1f} tok/s, {steps:.0f} steps; "
            f"ms a step: {phases}",
            flush=True,
        )


if __name__ == "__main__":
    main()
