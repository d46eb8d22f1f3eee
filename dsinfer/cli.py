"""The `dsinfer` command line: generate, serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from dsinfer.config import CacheConfig, EngineConfig, SchedulerConfig, parse_memory
from dsinfer.distributed.parallel_state import check_grid


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="activations and KV cache; float16 is served as bfloat16 (same range, fast on CPUs)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda | npu | auto")
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "reference", "fused"],
        help="kernels: fused (CPU fast path), reference (eager torch, the exactness oracle), "
        "auto (fused where it runs)",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="weights quantised at load; auto: a Q4_0/Q4_1/Q8_0 GGUF keeps int4/int8 "
        "(bf16 activations) unless --dtype float32",
    )
    p.add_argument("--kv-cache-memory", default="512MiB", help="KV pool budget, e.g. 512MiB")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="override the budget")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer source if not the model's own")
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the text) replacing the tokenizer's",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="build from config.json with seeded random weights (speed/memory only)",
    )
    p.add_argument(
        "--random-quant",
        default="none",
        choices=["none", "int8", "int4"],
        help="with --random-weights: quantised layouts (configs too large for float weights)",
    )
    p.add_argument(
        "--trusted-key",
        action="append",
        default=[],
        metavar="PUB",
        help="public key an artifact's signature must verify with (repeatable; "
        "also DSINFER_TRUSTED_KEYS)",
    )
    p.add_argument(
        "--parallel",
        default=None,
        metavar="auto|tp=N,pp=M,ep=K",
        help="tensor × pipeline (× expert) parallel over processes (torch.distributed), e.g. "
        "tp=2, pp=2, tp=2,pp=2, tp=4,ep=4; auto: plan for this machine",
    )
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="vLLM's spelling of --parallel tp=N",
    )
    p.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="vLLM's spelling of --parallel pp=N",
    )
    p.add_argument(
        "--device-profile",
        default=None,
        metavar="NAME|JSON",
        help="peaks that MBU/MFU are measured against (a built-in profile or a `dsinfer probe` "
        "JSON); default: this CPU, measured at start-up",
    )
    p.add_argument("--nnodes", type=int, default=1, help="machines the ranks spread over")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index (0 serves)")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
    p.add_argument(
        "--master-port", type=int, default=None, help="node 0's rendezvous port (several nodes)"
    )
    p.add_argument(
        "--no-mtp",
        action="store_true",
        help="do not use a DeepSeek-V3 checkpoint's MTP layer for speculative decoding",
    )
    p.add_argument(
        "--allow-unsigned",
        action="store_true",
        help="opt out of the trust policy: load unsigned artifacts and raw checkpoints",
    )


def parse_parallel(spec: str | None) -> tuple[int, int, int]:
    """`tp=N,pp=M,ep=K` (any of them, any order) → (tp, pp, ep); `auto` → (0, 0, 0), planned
    later against the model."""
    if spec is None:
        return 1, 1, 1
    if spec == "auto":
        return 0, 0, 0  # resolved against the model by resolve_parallel
    sizes = {"tp": 1, "pp": 1, "ep": 1}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key not in sizes or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--parallel {spec!r}: write auto or tp=N,pp=M,ep=K (any of them)")
        sizes[key] = int(value)
    check_grid(sizes["tp"], sizes["pp"], sizes["ep"])
    return sizes["tp"], sizes["pp"], sizes["ep"]


def resolve_parallel(spec: str | None, model: str) -> tuple[int, int, int]:
    tp, pp, ep = parse_parallel(spec)
    if tp == 0:
        from dsinfer.planner.auto import choose_parallel

        return choose_parallel(model)
    return tp, pp, ep


def parallel_spec(args: argparse.Namespace) -> str | None:
    """--parallel, or vLLM's --tensor-parallel-size / --pipeline-parallel-size."""
    sizes = [
        f"{key}={n}"
        for key, n in (("tp", args.tensor_parallel_size), ("pp", args.pipeline_parallel_size))
        if n is not None
    ]
    if sizes and args.parallel is not None:
        raise ValueError(
            "give the grid once: --parallel, or --tensor-parallel-size/--pipeline-parallel-size"
        )
    return ",".join(sizes) if sizes else args.parallel


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    args.parallel = parallel_spec(args)
    args.tensor_parallel_size = args.pipeline_parallel_size = None  # folded into --parallel
    if args.parallel == "auto" and args.nnodes > 1:
        # Each node would probe and plan on its own and could pick another grid: the group
        # would never form. Every node must be given the same grid.
        raise ValueError(
            "--parallel auto plans for one machine: with --nnodes > 1 give every node the "
            "same grid (e.g. --parallel tp=4,pp=2)"
        )
    tp, pp, ep = resolve_parallel(args.parallel, model)
    return EngineConfig(
        model=model,
        dtype=args.dtype,
        device=args.device,
        backend=args.backend,
        quantization=args.quantization,
        seed=args.seed,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        device_profile=args.device_profile,
        random_weights=args.random_weights,
        random_quant=args.random_quant,
        trusted_keys=tuple(args.trusted_key),
        allow_unsigned=args.allow_unsigned,
        mtp=not args.no_mtp,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        expert_parallel=ep,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=parse_memory(args.kv_cache_memory),
            num_blocks=args.num_kv_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        ),
    )


def run_worker_node(args: argparse.Namespace, model: str) -> int:
    """`--node-rank n > 0`: this machine only runs its ranks of node 0's engine."""
    from dsinfer.device import resolve_device
    from dsinfer.engine.llm_engine import load_for_config
    from dsinfer.worker.multiproc_executor import run_worker_node as run_node

    config = engine_config(args, model)
    return run_node(config, load_for_config, resolve_device(config.device))


def cmd_generate(args: argparse.Namespace) -> int:
    from dsinfer.engine.llm_engine import LLMEngine
    from dsinfer.sampling import SamplingParams

    if args.node_rank > 0:
        return run_worker_node(args, args.model)
    engine = LLMEngine(engine_config(args, args.model))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,  # --seed seeds the engine and, for generate, the sampler too
    )
    if args.chat:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = engine.tokenizer.encode(args.prompt)
    engine.add_request(ids, params)
    finish = None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
                if out.finished:
                    finish = out.outputs[0].finish_reason
    finally:
        engine.shutdown()
    sys.stdout.write("\n")
    logging.getLogger("dsinfer").info("finish_reason=%s", finish)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from dsinfer.server.launch import parse_model_spec, serve

    if args.model_tag:  # `dsinfer serve MODEL`, as `vllm serve MODEL`
        args.model = [args.model_tag, *args.model]
    if args.served_model_name:
        if len(args.model) > 1:
            raise ValueError("--served-model-name names one model; use NAME=PATH for several")
        path = parse_model_spec((args.model or ["smollm2"])[0])[1]
        args.model = [f"{args.served_model_name}={path}"]

    if args.nnodes > 1 and len(args.model or ["smollm2"]) > 1:
        raise ValueError("--nnodes > 1 serves one --model (its ranks span the nodes)")
    if args.node_rank > 0:
        return run_worker_node(args, parse_model_spec((args.model or ["smollm2"])[0])[1])
    return serve(args)


def version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("dsinfer")
    except PackageNotFoundError:  # run from a source tree that is not installed
        ours = "unknown"
    import torch

    return f"dsinfer {ours} (torch {torch.__version__})"


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_cmd == "report":
        from pathlib import Path

        from dsinfer.bench.report import report_from_files

        for path in report_from_files(args.results, Path(args.out)):
            print(f"wrote {path}")
        return 0
    if args.bench_cmd == "serve":
        from dsinfer.bench.serve import run_cli
    else:
        from dsinfer.bench.offline import run_cli
    return run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsinfer", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--version", action="version", version=version_text())
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="json: one JSON object per log line (finished requests carry their figures)",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--model", default="smollm2", help="HF directory, .gguf file or 'smollm2'")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    s.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model to serve ([NAME=]PATH, as `vllm serve MODEL`); more with --model",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the name clients send as `model` (default: the file or directory stem)",
    )
    s.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[NAME=]PATH",
        help="model to serve (repeatable); default: the embedded smollm2",
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    s.add_argument(
        "--admin-api-key",
        default=None,
        help="enable /admin/ (load, weights, promote, rollback, unload) with this key",
    )
    s.add_argument("--max-queued-requests", type=int, default=256)
    s.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    s.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive (slower or cut short: 408)",
    )
    s.add_argument(
        "--lenient-fields",
        action="store_true",
        help="drop unknown request fields with a log line instead of answering 400",
    )
    s.add_argument(
        "--public-docs",
        action="store_true",
        help="serve /docs and /openapi.json without the API key (with --api-key they need it)",
    )
    s.add_argument(
        "--log-prompts",
        action="store_true",
        help="put the prompt text in the request log (off by default: prompts may be private)",
    )
    s.add_argument(
        "--stats-interval",
        type=float,
        default=10.0,
        help="seconds between stats lines while busy (0: none)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=int,
        default=30,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    _engine_args(s)
    s.set_defaults(func=cmd_serve)

    from dsinfer.artifact.commands import add_parsers as artifact_parsers

    artifact_parsers(sub)
    from dsinfer.deploy import add_parser as deploy_parser

    deploy_parser(sub)
    from dsinfer.top import add_parser as top_parser

    top_parser(sub)
    from dsinfer.planner.commands import add_parsers as planner_parsers

    planner_parsers(sub)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    from dsinfer.bench.offline import add_args as offline_args
    from dsinfer.bench.serve import add_args as serve_args

    offline_args(bsub.add_parser("offline", help="offline throughput vs transformers"))
    serve_args(bsub.add_parser("serve", help="load-test an OpenAI-compatible server"))
    rep = bsub.add_parser("report", help="plot earlier `bench serve` results side by side")
    rep.add_argument("results", nargs="+", metavar="RESULT.json")
    rep.add_argument("--out", required=True, metavar="DIR")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dsinfer.logs import configure

    configure(args.verbose, args.log_format)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"dsinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
