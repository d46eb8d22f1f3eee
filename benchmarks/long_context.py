"""Long prompts, one stream: dsinfer against llama.cpp's llama-bench in the same run.

    python benchmarks/long_context.py [--depths 512,2048,4096,8000] [--new 64] [--rounds 2]
                                      [--llama-bench PATH] [--json OUT]

The serving comparison (serve_compare.py) uses ~128-token prompts; summaries and record
extraction feed thousands. Here, at each depth D, on the embedded SmolLM2 Q4_1 GGUF, 2 threads:
- prefill: a D-token prompt from nothing, tokens a second (llama-bench `-p D -n 0`);
- decode: `--new` tokens generated after D cached tokens, tokens a second (llama-bench
  `-p 0 -n NEW -d D`), where every token reads the whole cache: the attention kernel's test.

dsinfer runs in process as `make serve` configures it (the fused backend, int4 weights, bf16
activations), with the prefix cache off so that no round reuses another's prompt. Each round
runs llama-bench, then dsinfer (odd rounds) or the other way round (even), and gives the
ratios within the round: these machines drift by 25% over minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from serve_compare import llama_cpp_tool  # this folder's (scripts run as benchmarks/NAME.py)

from dsinfer import LLM, SamplingParams
from dsinfer.models.loader import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "long_text.txt"


def llama_side(bench: str, gguf: str, depths: list[int], new: int) -> dict[int, dict[str, float]]:
    """{depth: {"prefill": tok/s, "decode": tok/s}} from two llama-bench runs."""
    joined = ",".join(map(str, depths))
    runs = (
        ["-p", joined, "-n", "0"],  # prefill of a D-token prompt
        ["-p", "0", "-n", str(new), "-d", joined],  # decode after D cached tokens
    )
    out: dict[int, dict[str, float]] = {d: {} for d in depths}
    for extra in runs:
        cmd = [bench, "-m", gguf, "-t", "2", "-r", "1", "-o", "json", *extra]
        rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        for row in rows:
            if row["n_gen"]:
                out[row["n_depth"]]["decode"] = row["avg_ts"]
            else:
                out[row["n_prompt"]]["prefill"] = row["avg_ts"]
    return out


def dsinfer_side(
    llm: LLM, ids: list[int], depths: list[int], new: int
) -> dict[int, dict[str, float]]:
    out = {}
    for depth in depths:
        prompt = (ids * (depth // len(ids) + 1))[:depth]
        params = SamplingParams(temperature=0, max_tokens=new + 1, ignore_eos=True)
        m = llm.generate({"prompt_token_ids": prompt}, params)[0].metrics
        out[depth] = {
            "prefill": depth / (m.first_token_time - m.arrival_time),
            "decode": new / (m.finished_time - m.first_token_time),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--depths", default="512,2048,4096,8000")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llama-bench")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    torch.set_num_threads(2)
    bench = llama_cpp_tool("llama-bench", args.llama_bench)
    gguf = str(resolve_model_path("smollm2"))
    llm = LLM("smollm2", enable_prefix_caching=False)
    ids = llm.tokenizer.encode(TEXT.read_text())
    dsinfer_side(llm, ids, [512], 8)  # warm-up: first calls pay one-off costs
    rounds = []
    for r in range(args.rounds):
        sides = {}
        order = ("llama.cpp", "dsinfer") if r % 2 == 0 else ("dsinfer", "llama.cpp")
        for name in order:
            if name == "llama.cpp":
                sides[name] = llama_side(bench, gguf, depths, args.new)
            else:
                sides[name] = dsinfer_side(llm, ids, depths, args.new)
        rounds.append(sides)
        print(f"round {r + 1}")
        print(
            "| depth | prefill llama.cpp / dsinfer tok/s | ratio | decode llama.cpp / dsinfer tok/s | ratio |"
        )
        print("|---|---|---|---|---|")
        for d in depths:
            a, b = sides["llama.cpp"][d], sides["dsinfer"][d]
            print(
                f"| {d} | {a['prefill']:.0f} / {b['prefill']:.0f} | {b['prefill'] / a['prefill']:.2f}× "
                f"| {a['decode']:.1f} / {b['decode']:.1f} | {b['decode'] / a['decode']:.2f}× |"
            )
        sys.stdout.flush()
    print("median ratios over rounds (dsinfer / llama.cpp):")
    for d in depths:
        med = {
            k: statistics.median(s["dsinfer"][d][k] / s["llama.cpp"][d][k] for s in rounds)
            for k in ("prefill", "decode")
        }
        print(f"  depth {d}: prefill {med['prefill']:.2f}×, decode {med['decode']:.2f}×")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"depths": depths, "new": args.new, "rounds": rounds}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
