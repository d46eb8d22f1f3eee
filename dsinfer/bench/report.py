"""Benchmark results a reader would rather look at: JSON, a Markdown report and PNG plots.

`dsinfer bench serve --out DIR` (one or more servers, a sweep of concurrencies),
`dsinfer bench offline --out DIR`, and `dsinfer bench report A.json B.json --out DIR` (earlier
runs side by side) all end here. matplotlib draws headless (Agg).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _pyplot():  # noqa: ANN202
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def write_serve_report(series: dict[str, list[dict]], out: Path) -> list[Path]:
    """series: label (a server) → one report per concurrency. Writes serve.json, report.md,
    throughput.png, latency.png, distribution.png; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(series, indent=2) + "\n")
    plt = _pyplot()
    files = [out / "serve.json"]

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, reps in series.items():
        xs = [r["concurrency"] for r in reps]
        ax.plot(xs, [r["output_tokens_per_s"] for r in reps], marker="o", label=label)
    ax.set(xlabel="concurrent streams", ylabel="output tokens/s", title="Throughput")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    files.append(_save(fig, out / "throughput.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttft_s", "Time to first token"),
                           (axes[1], "itl_s", "Inter-token latency")):  # fmt: skip
        for label, reps in series.items():
            xs = [r["concurrency"] for r in reps]
            for q, style in (("p50", "-"), ("p99", "--")):
                ys = [1e3 * r[key][q] for r in reps]
                ax.plot(xs, ys, style, marker="o", label=f"{label} {q}")
        ax.set(xlabel="concurrent streams", ylabel="ms", title=title)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    files.append(_save(fig, out / "latency.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, reps in series.items():
        top = max(reps, key=lambda r: r["concurrency"])
        e2e = sorted(top.get("e2e_samples_s", []))
        if e2e:
            ys = [(i + 1) / len(e2e) for i in range(len(e2e))]
            ax.step(e2e, ys, where="post", label=f"{label} (c={top['concurrency']})")
    ax.set(xlabel="end-to-end latency (s)", ylabel="share of requests", title="Latency CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    files.append(_save(fig, out / "distribution.png"))

    files.append(_write(out / "report.md", _serve_markdown(series)))
    return files


def _serve_markdown(series: dict[str, list[dict]]) -> str:
    lines = ["# Serving benchmark", ""]
    labels = list(series)
    first = series[labels[0]][0]
    lines += [
        f"Prompts of ~{first['input_len']} words, {first['output_len']} new tokens, streamed.",
        "",
        "| server | concurrency | requests (errors) | output tok/s | TTFT p50 / p99 ms "
        "| ITL p50 / p99 ms | E2E p50 / p99 s |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, reps in series.items():
        for r in reps:
            lines.append(
                f"| {label} | {r['concurrency']} | {r['requests']} ({r['errors']}) | "
                f"{r['output_tokens_per_s']:.1f} | {1e3 * r['ttft_s']['p50']:.0f} / "
                f"{1e3 * r['ttft_s']['p99']:.0f} | {1e3 * r['itl_s']['p50']:.1f} / "
                f"{1e3 * r['itl_s']['p99']:.1f} | {r['e2e_s']['p50']:.2f} / "
                f"{r['e2e_s']['p99']:.2f} |"
            )
    if len(labels) > 1:
        lines += ["", f"Ratios against {labels[0]} (output tok/s, same run):", ""]
        base = {r["concurrency"]: r for r in series[labels[0]]}
        for label in labels[1:]:
            for r in series[label]:
                b = base.get(r["concurrency"])
                if b and b["output_tokens_per_s"]:
                    ratio = r["output_tokens_per_s"] / b["output_tokens_per_s"]
                    lines.append(f"- {label} at {r['concurrency']}: {ratio:.2f}×")
    lines += ["", "![throughput](throughput.png)", "", "![latency](latency.png)", "",
              "![distribution](distribution.png)", ""]  # fmt: skip
    return "\n".join(lines)


def write_offline_report(rows: list[dict], out: Path, batch: int) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "offline.json").write_text(json.dumps(rows, indent=2) + "\n")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [f"{r['engine']}\n{r['dtype']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["single_tok_s"] for r in rows], 0.4, label="1 stream")
    ax.bar([x + 0.2 for x in xs], [r["batch_tok_s"] for r in rows], 0.4, label=f"batch {batch}")
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set(ylabel="output tokens/s", title="Offline decode throughput")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    files = [out / "offline.json", _save(fig, out / "offline.png")]
    lines = ["# Offline benchmark", "",
             "| engine | dtype | 1 stream tok/s | batch tok/s | peak RSS MiB | load s |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['dtype']} | {r['single_tok_s']:.1f} | {r['batch_tok_s']:.1f} "
            f"| {r['peak_rss_mib']:.0f} | {r['load_s']:.1f} |"
        )
    lines += ["", "![offline](offline.png)", ""]
    files.append(_write(out / "report.md", "\n".join(lines)))
    return files


def report_from_files(paths: list[str], out: Path) -> list[Path]:
    """`dsinfer bench report A.json B.json`: earlier serve runs (serve.json files, or the
    single-report JSON of `--json`) plotted side by side, each series named by its file."""
    series: dict[str, list[dict]] = {}
    for p in paths:
        data: Any = json.loads(Path(p).read_text())
        if isinstance(data, dict) and "concurrency" in data:  # one --json report
            data = {Path(p).stem: [data]}
        if not isinstance(data, dict):
            raise ValueError(f"{p}: not a dsinfer bench serve result")
        for label, reps in data.items():
            key = label if len(paths) == 1 else f"{Path(p).stem}:{label}"
            series[key] = sorted(reps, key=lambda r: r["concurrency"])
    return write_serve_report(series, out)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
