"""llama.cpp's llama-server and dsinfer, one after the other in one run, on the same prompts.

Each server runs alone on the machine (the other is stopped), on the embedded SmolLM2 Q4_1 GGUF
(or --model, another GGUF: benchmarks/deepseek_gguf.py writes a DeepSeek-V2-Lite-shaped one);
the same streaming load (`dsinfer bench serve`: ~128-word prompts, 128 new tokens, ignore_eos,
same seed) runs at each concurrency. Prints both sides, the ratios, and each server's peak RSS
(VmHWM); writes everything to --out as JSON.

  python benchmarks/serve_compare.py [--llama-server PATH] [--dsinfer-config "ARGS"]... \
      [--llama-args "ARGS"] [--concurrency 1,16] [--out benchmarks/results/serve_compare]

Without --llama-server it uses ../shared/tools/build_llama_server.sh's build (building it the
first time, ~10 minutes). Each --dsinfer-config is one `dsinfer serve` argument string; the
default is the default server (no arguments).

--rounds N runs the whole sequence N times (llama-server first in odd rounds, last in even
ones) and takes every ratio within its round: the machines here drift by 25% over minutes, and a slow
spell that falls on one side of a single round moves its ratio by as much. The summary gives
each round's ratios and their median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dsinfer.bench.serve import report, run_load
from dsinfer.bench.stats import peak_rss_mib, wait_healthy
from dsinfer.models.loader import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT.parent / "shared" / "tools" / "build_llama_server.sh"


def load_levels(url: str, levels: list[int], args: argparse.Namespace) -> dict[int, dict]:
    out = {}
    for c in levels:
        ns = argparse.Namespace(
            url=url,
            model=None,
            api_key=None,
            concurrency=c,
            num_requests=args.num_requests or max(16, 4 * c),
            duration=None,
            input_len=args.input_len,
            output_len=args.output_len,
            # Prompts of their own at each level: with one seed for all, the 16-stream level's
            # first 16 prompts were the one-stream level's, and dsinfer's prefix cache answered
            # them in ~0.1 s (llama-server keeps one prompt a slot).
            seed=c,
            temperature=args.temperature,
            top_p=args.top_p,
        )
        # One warm-up request (a prompt of its own seed): neither side pays first-call costs
        # in the figures.
        warm = {**vars(ns), "num_requests": 1, "seed": 10_000 + c}
        asyncio.run(run_load(argparse.Namespace(**warm)))
        before = step_counters(url)
        results, wall = asyncio.run(run_load(ns))
        out[c] = report(results, wall, ns)
        r = out[c]
        after = step_counters(url)
        if before and after and after["seconds"] > before["seconds"]:
            # dsinfer's own accounting (docs/metrics.md) over exactly this level's steps.
            moved = after["bytes"] - before["bytes"]
            r["mbu"] = moved / (after["seconds"] - before["seconds"]) / after["peak"]
            r["bandwidth_busy"] = moved / (after["seconds"] - before["seconds"])
            r["peak_bandwidth"] = after["peak"]
        print(
            f"  c={c}: {r['output_tokens_per_s']:.1f} out tok/s, TTFT p50/p99 "
            f"{r['ttft_s']['p50']:.2f}/{r['ttft_s']['p99']:.2f} s, ITL p50 "
            f"{1e3 * r['itl_s']['p50']:.1f} ms, errors {r['errors']}",
            flush=True,
        )
    return out


def step_counters(url: str) -> dict[str, float] | None:
    """dsinfer's step totals (bytes, seconds) and peak bandwidth; None for other servers."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    if "dsinfer:step_bytes_total" not in text:
        return None
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return {
        "bytes": values["dsinfer:step_bytes_total"],
        "seconds": values["dsinfer:step_seconds_total"],
        "peak": values["dsinfer:peak_bandwidth_bytes_per_second"],
    }


def gguf_weight_bytes(path: str) -> tuple[int, bool]:
    """What llama.cpp reads per forward at most: every tensor (SmolLM2's head is the tied
    embedding, read whole for the logits); and whether the model routes experts (then a
    forward reads only the experts its tokens chose, and the figure overstates)."""
    from dsinfer.models.gguf_reader import GGUFFile

    tensors = GGUFFile(path).tensors
    moe = any("_exps." in t.name for t in tensors)
    return sum(t.data.nbytes for t in tensors), moe


def run_server(name: str, cmd: list[str], url: str, levels: list[int], args, log_name: str) -> dict:  # noqa: ANN001
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    log = open(Path(args.out) / f"{log_name}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        start_s = wait_healthy(url, proc)
        print(f"  healthy after {start_s:.1f} s", flush=True)
        res = load_levels(url, levels, args)
        return {
            "cmd": cmd,
            "start_s": start_s,
            "peak_rss_mib": peak_rss_mib(proc.pid),
            "levels": res,
        }
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def llama_cpp_tool(name: str, given: str | None = None) -> str:
    """`given`, else llama.cpp's `name` (llama-server, llama-bench) from
    ../shared/tools/build_llama_server.sh's build (built the first time, ~10 minutes)."""
    if given:
        return given
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=True)
    return str(Path(out.stdout.strip().splitlines()[-1]) / name)


def config_name(extra: str) -> str:
    return f"dsinfer {extra}".strip() if extra else "dsinfer (default)"


def dsinfer_cmd(extra: str, port: int, model: list[str]) -> list[str]:
    return [
        str(ROOT / ".venv" / "bin" / "dsinfer"),
        "serve",
        "--port",
        str(port),
        *model,
        *shlex.split(extra),
    ]


def print_round(runs: dict[str, dict], levels: list[int]) -> None:
    base = runs["llama-server"]
    print(
        "\n| server | start s | peak RSS MiB | "
        + " | ".join(f"c={c} tok/s (×) | c={c} TTFT p99 s | c={c} ITL p50 ms" for c in levels)
        + " |"
    )
    for name, r in runs.items():
        cells = [name, f"{r['start_s']:.1f}", f"{r['peak_rss_mib']:.0f}"]
        for c in levels:
            lv, b = r["levels"][c], base["levels"][c]
            ratio = lv["output_tokens_per_s"] / b["output_tokens_per_s"]
            cells += [
                f"{lv['output_tokens_per_s']:.1f} ({ratio:.2f}×)",
                f"{lv['ttft_s']['p99']:.2f}",
                f"{1e3 * lv['itl_s']['p50']:.1f}",
            ]
        print("| " + " | ".join(cells) + " |")


def print_bandwidth(runs: dict[str, dict], levels: list[int], gguf: str) -> None:
    base = runs["llama-server"]
    weights, moe = gguf_weight_bytes(gguf)
    print(f"\nBandwidth (weights read per forward: llama-server {weights / 2**20:.0f} MiB):")
    if moe:
        print("  (a MoE model: a forward reads only the routed experts it chose; the llama-server")
        print("  figures below take every weight, so they overstate its bandwidth)")
    for c in levels:
        b = base["levels"][c]
        # One forward serves all the streams that decode together: ~min(c, 16) tokens.
        forwards = b["output_tokens_per_s"] / min(c, 16)
        print(
            f"  c={c}: llama-server effective {weights * forwards / 1e9:.2f} GB/s (weights × "
            f"forwards/s); dsinfer:",
            end="",
        )
        for name, r in runs.items():
            lv = r["levels"][c]
            if "mbu" in lv:
                print(
                    f" [{name}] MBU {100 * lv['mbu']:.1f}% ({lv['bandwidth_busy'] / 1e9:.2f} "
                    f"of {lv['peak_bandwidth'] / 1e9:.1f} GB/s)",
                    end="",
                )
        print()


def print_summary(rounds: list[dict[str, dict]], levels: list[int]) -> None:
    """Each dsinfer config's ratios to llama-server round by round, and their medians."""
    print(
        "\n| config | "
        + " | ".join(f"c={c} tok/s ×, per round (median)" for c in levels)
        + f" | c={levels[-1]} TTFT p99 ratio, per round (median) | peak RSS MiB vs llama |"
    )
    print("|---" * (len(levels) + 3) + "|")
    for name in rounds[0]:
        if name == "llama-server":
            continue
        cells = [name]
        for c in levels:
            ratios = [
                r[name]["levels"][c]["output_tokens_per_s"]
                / r["llama-server"]["levels"][c]["output_tokens_per_s"]
                for r in rounds
            ]
            cells.append(_per_round(ratios, "×"))
        top = levels[-1]
        ttft = [
            r[name]["levels"][top]["ttft_s"]["p99"]
            / r["llama-server"]["levels"][top]["ttft_s"]["p99"]
            for r in rounds
        ]
        cells.append(_per_round(ttft, ""))
        rss = " / ".join(
            f"{r[name]['peak_rss_mib']:.0f} vs {r['llama-server']['peak_rss_mib']:.0f}"
            for r in rounds
        )
        cells.append(rss)
        print("| " + " | ".join(cells) + " |")


def _per_round(values: list[float], unit: str) -> str:
    return (
        ", ".join(f"{v:.2f}{unit}" for v in values)
        + f" (**{statistics.median(values):.2f}{unit}**)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama-server", default=None)
    p.add_argument("--dsinfer-config", action="append", default=None)
    # llama.cpp 0.3.36 built with -march=native crashes with its weight repacking on session
    # 36's AMX Xeon (SmolLM2 and DeepSeek-V2 files alike): --llama-args "--no-repack" serves
    # there (docs/benchmarks.md, session 36, has a build that keeps the repacking).
    p.add_argument(
        "--llama-args", default="", help="more llama-server arguments, one string (shell words)"
    )
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    # Sampled requests (e.g. --temperature 0.7 --top-p 0.95, a chat client's usual settings):
    # both servers draw every token instead of taking the argmax.
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--port", type=int, default=8131)
    p.add_argument(
        "--model",
        default="smollm2",
        help="the GGUF both servers serve (default: the embedded SmolLM2); e.g. a DeepSeek one "
        "written by benchmarks/deepseek_gguf.py",
    )
    p.add_argument(
        "--num-requests", type=int, default=None, help="per level (default: max(16, 4 × c))"
    )
    p.add_argument("--out", default="benchmarks/results/serve_compare")
    p.add_argument(
        "--rounds", type=int, default=1, help="repeat the sequence N times, ratios per round"
    )
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    gguf = str(resolve_model_path(args.model))
    url = f"http://127.0.0.1:{args.port}"
    llama = [
        llama_cpp_tool("llama-server", args.llama_server),
        "-m",
        gguf,
        "-t",
        "2",
        "--parallel",
        "16",
        "-c",
        "16384",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        *shlex.split(args.llama_args),
    ]
    configs = args.dsinfer_config or [""]
    model = [] if args.model == "smollm2" else ["--model", gguf]  # dsinfer serve's default
    rounds = []
    for k in range(args.rounds):
        if args.rounds > 1:
            print(f"\n#### round {k + 1} of {args.rounds}", flush=True)
        tag = f"-r{k + 1}" if args.rounds > 1 else ""
        # Servers in turn: llama-server first in odd rounds, last in even ones, so that a drift
        # across a round does not favour the same side every time.
        jobs: list[tuple[str, list[str], str]] = [("llama-server", llama, f"llama-server{tag}")]
        jobs += [
            (config_name(extra), dsinfer_cmd(extra, args.port, model), f"dsinfer-{i}{tag}")
            for i, extra in enumerate(configs)
        ]
        if k % 2:
            jobs = jobs[1:] + jobs[:1]
        measured = {name: run_server(name, cmd, url, levels, args, log) for name, cmd, log in jobs}
        # Printed and stored llama-server first, whatever the order they ran in.
        runs = {"llama-server": measured.pop("llama-server"), **measured}
        print_round(runs, levels)
        print_bandwidth(runs, levels, gguf)
        rounds.append(runs)
    if args.rounds > 1:
        print_summary(rounds, levels)
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": rounds[0]}
    if args.rounds > 1:
        result["rounds"] = rounds
    (Path(args.out) / "serve_compare.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
