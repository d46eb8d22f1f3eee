"""The `dsinfer` command line: generate, serve, bench."""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from dsinfer.engine_args import DEFAULT_MODEL, engine_config
from dsinfer.engine_args import add_engine_flags as _engine_args


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
    from dsinfer.server.api import ServerSettings
    from dsinfer.server.launch import ServeOptions, parse_model_spec, serve

    if args.model_tag:  # `dsinfer serve MODEL`, as `vllm serve MODEL`
        args.model = [args.model_tag, *args.model]
    if args.served_model_name:
        if len(args.model) > 1:
            raise ValueError("--served-model-name names one model; use NAME=PATH for several")
        path = parse_model_spec((args.model or [DEFAULT_MODEL])[0])[1]
        args.model = [f"{args.served_model_name}={path}"]

    if args.nnodes > 1 and len(args.model or [DEFAULT_MODEL]) > 1:
        raise ValueError("--nnodes > 1 serves one --model (its ranks span the nodes)")
    if args.node_rank > 0:
        return run_worker_node(args, parse_model_spec((args.model or [DEFAULT_MODEL])[0])[1])
    settings = ServerSettings(
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        max_queued_requests=args.max_queued_requests,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        public_docs=args.public_docs,
        lenient_fields=args.lenient_fields,
        log_prompts=args.log_prompts,
        stats_interval_s=args.stats_interval,
    )
    opts = ServeOptions(args.host, args.port, args.model, settings, args.shutdown_timeout)
    return serve(opts, functools.partial(engine_config, args))


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
    g.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"HF directory, .gguf file or '{DEFAULT_MODEL}'"
    )
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
        help=f"model to serve (repeatable); default: the embedded {DEFAULT_MODEL}",
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
