"""`dsinfer bench offline`: our engine vs transformers `generate` on the same prompts, same run.

Each (engine, dtype) runs in its own process so that peak RSS is that engine's alone.
Workloads: single stream (1 prompt → N new tokens) and a batch of B prompts → N new tokens each.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from dsinfer.bench.serve import WORDS
from dsinfer.progress import progress


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--engines", default="dsinfer,transformers")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--artifact",
        action="append",
        default=[],
        metavar="PATH",
        help="also run dsinfer on this compiled artifact (repeatable; label: its scheme)",
    )
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument(
        "--out", default=None, metavar="DIR", help="write offline.json, report.md and a plot"
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def make_prompts(n: int, words: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words)) for i in range(n)]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _ours(args: argparse.Namespace, dtype: str) -> dict:
    from dsinfer import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=dtype, kv_cache_memory="256MiB", enable_prefix_caching=False)
    load = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = make_prompts(args.batch, args.input_len)
    llm.generate(prompts[0], SamplingParams(max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts[0], params)
    single = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    batch = time.perf_counter() - t0
    n_prompt = sum(len(o.prompt_token_ids) for o in outs) / len(outs)
    runner = llm.engine.executor.runner
    schemes = {
        getattr(getattr(m, "method", None), "scheme", "float")
        for m in runner.model.modules()
        if hasattr(m, "method")
    }
    return {
        "load_s": load,
        "single_s": single,
        "batch_s": batch,
        "prompt_tokens": n_prompt,
        # What "dtype" meant for this run: a Q4 GGUF keeps int4 weights unless float32.
        "config": f"{'+'.join(sorted(schemes))} weights, {runner.backend} backend",
    }


def _transformers(args: argparse.Namespace, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsinfer.models.loader import resolve_model_path

    path = resolve_model_path(args.model)
    t0 = time.perf_counter()
    kw = {"gguf_file": path.name} if path.is_file() else {}
    root = str(path.parent if path.is_file() else path)
    model = AutoModelForCausalLM.from_pretrained(root, dtype=getattr(torch, dtype), **kw).eval()
    tok = AutoTokenizer.from_pretrained(root, **kw)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    load = time.perf_counter() - t0
    prompts = make_prompts(args.batch, args.input_len)
    gen = dict(
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )

    def run(ps: list[str]) -> float:
        enc = tok(ps, return_tensors="pt", padding=True)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, **gen)
        return time.perf_counter() - t

    run(prompts[:1])  # warm-up
    return {
        "load_s": load,
        "single_s": run(prompts[:1]),
        "batch_s": run(prompts),
        "prompt_tokens": float(len(tok(prompts[0]).input_ids)),
    }


def _worker(args: argparse.Namespace) -> int:
    engine, dtype = args.worker.split(":")
    import torch

    torch.set_num_threads(torch.get_num_threads())
    res = (_ours if engine == "dsinfer" else _transformers)(args, dtype)
    res["peak_rss_mib"] = _peak_rss_mib()
    print("RESULT " + json.dumps(res))
    return 0


def _jobs(args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """(engine, dtype label, worker dtype, model) for every run, checkpoints then artifacts."""
    jobs = [
        (engine, dtype, dtype, args.model)
        for dtype in args.dtypes.split(",")
        if dtype
        for engine in args.engines.split(",")
        if engine
    ]
    for path in args.artifact:
        from dsinfer.artifact.manifest import read_manifest

        scheme = read_manifest(Path(path)).quantization["scheme"]
        jobs.append(("dsinfer", f"art:{scheme}", "auto", path))
    return jobs


def run_cli(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    rows = []
    jobs = list(_jobs(args))
    with progress("benchmark runs", len(jobs)) as advance:
        for job in jobs:
            row = _run_job(args, *job)
            if row is None:
                return 1
            rows.append(row)
            advance(1)
    _print_ratios(args, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.out:
        from dsinfer.bench.report import write_offline_report

        for path in write_offline_report(rows, Path(args.out), args.batch):
            print(f"wrote {path}")
    return 0


def _run_job(
    args: argparse.Namespace, engine: str, label: str, dtype: str, model: str
) -> dict | None:
    """One measurement in its own process; None (after saying why) when it failed."""
    cmd = [
        sys.executable,
        "-m",
        "dsinfer.cli",
        "bench",
        "offline",
        "--worker",
        f"{engine}:{dtype}",
        "--model",
        model,
        "--batch",
        str(args.batch),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(f"{engine} {label}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    r = json.loads(line[7:])
    r.update(
        engine=engine,
        dtype=label,
        single_tok_s=args.output_len / r["single_s"],
        batch_tok_s=args.batch * args.output_len / r["batch_s"],
    )
    print(
        f"{engine:13s} {label:9s} single {r['single_tok_s']:7.1f} tok/s   "
        f"batch{args.batch} {r['batch_tok_s']:7.1f} tok/s   "
        f"peak RSS {r['peak_rss_mib']:7.0f} MiB   load {r['load_s']:.1f}s"
        + (f"   ({r['config']})" if "config" in r else ""),
        flush=True,
    )
    return r


def _print_ratios(args: argparse.Namespace, rows: list[dict]) -> None:
    by = {(r["engine"], r["dtype"]): r for r in rows}
    for dtype in args.dtypes.split(","):
        a, b = by.get(("dsinfer", dtype)), by.get(("transformers", dtype))
        if a and b:
            print(
                f"ratio dsinfer/transformers {dtype}: single "
                f"{a['single_tok_s'] / b['single_tok_s']:.2f}x, batch "
                f"{a['batch_tok_s'] / b['batch_tok_s']:.2f}x, peak RSS "
                f"{a['peak_rss_mib'] / b['peak_rss_mib']:.2f}x"
            )
    ref = by.get(("transformers", "bfloat16")) or by.get(("transformers", "float32"))
    for r in rows:
        if ref and r["dtype"].startswith("art:"):
            print(
                f"ratio {r['dtype']}/transformers {ref['dtype']}: single "
                f"{r['single_tok_s'] / ref['single_tok_s']:.2f}x, batch "
                f"{r['batch_tok_s'] / ref['batch_tok_s']:.2f}x, peak RSS "
                f"{r['peak_rss_mib'] / ref['peak_rss_mib']:.2f}x"
            )
