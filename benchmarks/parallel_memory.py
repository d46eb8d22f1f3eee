"""Resident memory per rank: each rank must hold only its shard. DeepSeek-V2-Lite shapes (random
bf16 weights, 4 of 27 layers, as in parallel_honesty.py) in one process and under tp=2, pp=2,
ep=2 and tp=2,ep=2; every process's VmRSS after a short generation (KV pool 64 MiB).

    python benchmarks/parallel_memory.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from parallel_honesty import _tokenizer, v2_lite_config  # noqa: E402

PLANS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)]


def rss_per_rank(config: Path, plan: tuple[int, int, int]) -> list[float]:
    tp, pp, ep = plan
    code = f"""
import os
from dsinfer import LLM, SamplingParams
llm = LLM({str(config)!r}, random_weights=True, dtype='bfloat16', kv_cache_memory='64MiB',
          tokenizer={_tokenizer("deepseek-v2")!r}, tensor_parallel={tp}, pipeline_parallel={pp},
          expert_parallel={ep})
llm.generate([{{"prompt_token_ids": [100000, 5, 6, 7]}}], SamplingParams(max_tokens=4))
executor = llm.engine.executor
pids = [os.getpid()] + [p.pid for p in getattr(executor, "procs", [])]
def rss(pid):
    for line in open(f"/proc/{{pid}}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024**2
print("RSS", " ".join(f"{{rss(p):.2f}}" for p in pids))
llm.engine.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    line = next(x for x in out.stdout.splitlines() if x.startswith("RSS"))
    return [float(v) for v in line.split()[1:]]


def main() -> int:
    config = v2_lite_config(Path(tempfile.mkdtemp(prefix="v2lite-")))
    print("plan            RSS per rank (GiB)         total")
    for plan in PLANS:
        ranks = rss_per_rank(config, plan)
        name = "tp={},pp={}".format(*plan) + (f",ep={plan[2]}" if plan[2] > 1 else "")
        print(f"{name:14s}  {', '.join(f'{r:.2f}' for r in ranks):24s}  {sum(ranks):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
