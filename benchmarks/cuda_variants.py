"""Variants of the fused CUDA decode step, timed one after another in one process (a lent GPU
machine's experiment, prepared where there is none): what each candidate change is worth
before it is made the default.

- `fused`: the step as shipped (torch's fused RMSNorm, SDPA decode attention, CUDA graphs).
- `fused-reference-norms`: the same with the reference's spelled-out RMSNorm (six kernels a
  norm): what the fused norm is worth.
- `fused-compiled-layers`: every decoder layer's forward through torch.compile (inductor's
  fused kernels), inside the same CUDA graphs: what a compiled step would be worth.
- `fused-context-buckets-of-4`: the same graphs over context buckets of every 4 blocks
  instead of powers of two (less padding gathered and attended: at 129-176 tokens of context
  a step attends over 12 blocks instead of 16), at the price of more graphs to record.
- `reference`: eager, the baseline.

Each variant's error, if it fails, is printed and the next one runs.

    python benchmarks/cuda_variants.py [--config NAME] [--batches 1,16] [--variants a,b]
        [--json OUT]   (--device cpu --config DIR: a dry run on a tiny checkpoint)"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path

import torch
from cuda_decode import decode_run, random_llm  # benchmarks/ is the script's folder

from dsinfer import LLM
from dsinfer.layers.kernels import REFERENCE
from dsinfer.layers.norm import RMSNorm

VARIANTS = (
    "fused",
    "fused-reference-norms",
    "fused-context-buckets-of-4",
    "fused-compiled-layers",
    "reference",
)


def _reference_norms(llm: LLM) -> None:
    for m in llm.engine.executor.runner.model.modules():
        if isinstance(m, RMSNorm):
            m.kernels = dataclasses.replace(
                m.kernels, rms_norm=REFERENCE.rms_norm, add_rms_norm=REFERENCE.add_rms_norm
            )


def _context_buckets_of(llm: LLM, step: int) -> None:
    graphs = llm.engine.executor.runner.graphs
    assert graphs is not None, "no decode graphs here (they are recorded on CUDA)"
    assert not graphs.graphs, "buckets are set before the first graph is recorded"
    most = graphs.context_buckets[-1]
    small = [b for b in graphs.context_buckets if b < step]
    graphs.context_buckets = tuple(sorted({*small, *range(step, most, step), most}))


def _compiled_layers(llm: LLM) -> None:
    # Each bucket's shapes, and each norm's with and without a residual, are compiles of
    # their own: more than dynamo's default limit of 8 a function.
    torch._dynamo.config.recompile_limit = 64
    for layer in llm.engine.executor.runner.model.model.layers:
        layer.compile(dynamic=None)  # a second shape (another bucket) makes its sizes dynamic


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="deepseek-llm-7b-base")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokenizer", default=".cuda/tokenizer")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cuda = args.device == "cuda"
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for variant in args.variants.split(","):
        t0 = time.perf_counter()
        llm = None
        try:
            llm = random_llm(
                args.config,
                args.device,
                "reference" if variant == "reference" else "fused",
                args.tokenizer,
                "8GiB",
                step_program=cuda or variant == "reference",  # the CPU program has no variants
            )
            if variant == "fused-reference-norms":
                _reference_norms(llm)
            elif variant == "fused-context-buckets-of-4":
                _context_buckets_of(llm, 4)
            elif variant == "fused-compiled-layers":
                _compiled_layers(llm)
            for batch in batches:
                r = decode_run(llm, batch, args.prompt_len, args.new_tokens)
                rows.append({"variant": variant, "batch": batch, **r})
                print(
                    f"{variant:24s} batch {batch:3d}: {r['step_ms']:7.2f} ms a step, "
                    f"{r['decode_tok_s']:8.1f} tok/s ({time.perf_counter() - t0:.0f} s so far)",
                    flush=True,
                )
        except Exception as e:  # noqa: BLE001  (an experiment: report, go on)
            rows.append({"variant": variant, "error": f"{type(e).__name__}: {e}"[:500]})
            print(f"{variant:24s} failed: {rows[-1]['error']}", flush=True)
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
