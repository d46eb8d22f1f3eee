"""Two models served by one `dsinfer serve`, both under load at once, with the cores shared
between their engines (device/host_threads.CoreShare, the default) and without
(DSINFER_CORE_SHARE=off: each engine steps on every core), in one run.

    python benchmarks/two_models_served.py [--streams 1 16] [--rounds 2] [--json OUT]

The server serves the embedded SmolLM2 twice (`--model a=smollm2 --model b=smollm2`, as `make
serve` configures it), a stand-in for two models or a canary's two versions. Two `dsinfer bench
serve` clients, one a model, run at the same time (128 words in, 64 tokens out); the figure is
the sum of their output tok/s. The two ways alternate: a server for each, every round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from dsinfer.bench.stats import wait_healthy
from dsinfer.distributed.parallel_state import free_local_port


def measure(share: str, streams_list: list[int], output_len: int) -> dict[int, dict]:
    """{streams: {model: report}} from one server with DSINFER_CORE_SHARE=share."""
    port = free_local_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DSINFER_CORE_SHARE": share}
    cmd = [sys.executable, "-m", "dsinfer.cli", "serve", "--model", "a=smollm2"]
    cmd += ["--model", "b=smollm2", "--port", str(port)]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, server)
        found: dict[int, dict] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for streams in streams_list:
                clients = {}
                for model in ("a", "b"):
                    out = Path(tmp) / f"{model}_{streams}.json"
                    bench = [sys.executable, "-m", "dsinfer.cli", "bench", "serve", "--url", url]
                    bench += ["--model", model, "--concurrency", str(streams)]
                    bench += ["--num-requests", str(4 * streams), "--input-len", "128"]
                    bench += ["--output-len", str(output_len), "--json", str(out)]
                    clients[model] = (subprocess.Popen(bench, stdout=subprocess.DEVNULL), out)
                for proc, _ in clients.values():
                    if proc.wait() != 0:
                        raise RuntimeError(f"bench serve exited with {proc.returncode}")
                found[streams] = {m: json.loads(out.read_text()) for m, (_, out) in clients.items()}
        return found
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write every round's reports here")
    args = ap.parse_args()
    rounds: list[dict] = []
    best: dict[tuple[str, int], float] = {}
    for r in range(args.rounds):
        for share in ("on", "off"):
            got = measure(share, args.streams, args.output_len)
            for streams, by_model in got.items():
                total = sum(rep["output_tokens_per_s"] for rep in by_model.values())
                errors = sum(rep["errors"] for rep in by_model.values())
                p99 = max(rep["itl_s"]["p99"] for rep in by_model.values())
                print(
                    f"round {r + 1}, core share {share}, {streams} stream(s) a model: "
                    f"{total:.1f} output tok/s over both, ITL p99 {1e3 * p99:.1f} ms, "
                    f"{errors} errors",
                    flush=True,
                )
                best[(share, streams)] = max(best.get((share, streams), 0.0), total)
                rounds.append({"round": r + 1, "share": share, "streams": streams, **by_model})
    for streams in args.streams:
        on, off = best[("on", streams)], best[("off", streams)]
        print(
            f"{streams} stream(s) a model, best round: shared {on:.1f}, every core each "
            f"{off:.1f} output tok/s over both models: {on / off:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
