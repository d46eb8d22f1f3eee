"""Load time: process start → first generated token, for the GGUF loaded directly and for
compiled artifacts. Each run is a fresh `dsinfer generate` process; one untimed run first puts
the files in the page cache, so the figures are warm-cache (the usual restart case).

    python benchmarks/artifact_load.py --artifact /tmp/art/fp32 --artifact /tmp/art/int8 ...
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def time_to_first_token(model: str, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "dsinfer.cli", "generate", "--model", model]
    cmd += ["--prompt", "The capital of France is", "--max-tokens", "2", "--num-kv-blocks", "64"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd + extra, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    first = proc.stdout.read(1)  # generate streams each token as soon as it is sampled
    elapsed = time.perf_counter() - t0
    proc.wait()
    if not first or proc.returncode:
        raise SystemExit(f"{model}: generate failed (exit {proc.returncode})")
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2", help="the checkpoint loaded directly")
    p.add_argument("--artifact", action="append", default=[])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trusted-key", default=None, help="verify signatures as `serve` would")
    args = p.parse_args()
    runs = [(f"{args.model} fp32 (direct)", args.model, ["--dtype", "float32"])]
    runs.append((f"{args.model} bf16 (direct)", args.model, ["--dtype", "bfloat16"]))
    trust = ["--trusted-key", args.trusted_key] if args.trusted_key else ["--allow-unsigned"]
    runs += [(f"artifact {a}", a, trust) for a in args.artifact]
    results = {}
    for label, model, extra in runs:
        time_to_first_token(model, extra)  # warm the page cache
        times = [time_to_first_token(model, extra) for _ in range(args.repeats)]
        results[label] = statistics.median(times)
        print(f"{label:50s} first token after {results[label]:.2f} s (median of {args.repeats})")
    base = results[runs[0][0]]
    for label, t in results.items():
        print(f"{label:50s} {base / t:.2f}x faster than {runs[0][0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
