"""One decode step four ways: is the captured step program faster than inductor?

  python benchmarks/inductor_compare.py [--rows 1,16] [--context 128] [--json PATH]

Loads the embedded model as `make serve` does (its Q4_1 weights as int4, bf16 activations) on
both backends, builds one decode step of ROWS sequences that each hold CONTEXT cached tokens,
and times the step's forward plus its LM head:

  reference eager      the reference backend, torch ops one by one
  reference inductor   the same module under torch.compile (inductor, freezing, C++ wrapper),
                       compiled once per row count, as a bucket would be
  fused eager          the fused kernels, layer by layer from Python
  fused program        the fused kernels replayed by the captured DecodeProgram (the default)

Each figure is the best of 5 runs of 20 steps, same process, same weights. Not a test: it
prints the table (and writes it as JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from dsinfer import LLM
from dsinfer.bench.stats import best_seconds
from dsinfer.worker.input_batch import build_model_input
from dsinfer.worker.step_io import ScheduledSeq


def _best_ms(step: Callable[[], torch.Tensor], runs: int = 5, steps: int = 20) -> float:
    return 1e3 * best_seconds(step, calls=steps, rounds=runs, warmup=3)


def _decode_step(llm: LLM, rows: int, context: int, program: bool) -> Callable[[], torch.Tensor]:
    """A callable running one decode step (forward + LM head) of `rows` sequences at position
    `context`; the KV slots it writes are its own blocks, allocated once."""
    engine = llm.engine
    runner, bs = engine.executor.runner, engine.block_size
    model = runner.model
    if not program:
        model.step_program = None
    tables = [engine.pool.allocate(-(-(context + 1) // bs)) for _ in range(rows)]
    seqs = [
        ScheduledSeq(f"s{i}", [100 + i], context, t, do_sample=True) for i, t in enumerate(tables)
    ]
    inp = build_model_input(seqs, bs, runner.device)

    def step() -> torch.Tensor:
        hidden = model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
        return model.compute_logits(hidden)

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,16")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights folded in as constants (inference only)
    inductor_config.cpp_wrapper = True  # the graph's glue in C++, not Python
    results: dict[str, dict[str, float]] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        row: dict[str, float] = {}
        with torch.inference_mode():
            ref = LLM("smollm2", backend="reference", kv_cache_memory="128MiB")
            step = _decode_step(ref, rows, args.context, program=False)
            row["reference eager"] = _best_ms(step)
            t0 = time.perf_counter()
            compiled = torch.compile(step)
            compiled()
            row["inductor compile s"] = time.perf_counter() - t0
            row["reference inductor"] = _best_ms(compiled)
            torch._dynamo.reset()
            del ref, step, compiled
            fused = LLM("smollm2", kv_cache_memory="128MiB")
            assert fused.engine.executor.runner.model.step_program is not None
            row["fused program"] = _best_ms(_decode_step(fused, rows, args.context, program=True))
            row["fused eager"] = _best_ms(_decode_step(fused, rows, args.context, program=False))
            del fused
        results[f"{rows} rows"] = row
        print(
            f"{rows:>3} rows, {args.context} cached tokens each: "
            + ", ".join(
                f"{k} {v:.1f} s" if k.endswith(" s") else f"{k} {v:.2f} ms" for k, v in row.items()
            )
        )
        best_other = min(row["reference eager"], row["reference inductor"], row["fused eager"])
        print(f"    program vs the best other: {best_other / row['fused program']:.2f}x faster")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "steps_ms": results}, f, indent=1)


if __name__ == "__main__":
    main()
