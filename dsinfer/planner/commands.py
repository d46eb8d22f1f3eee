"""`dsinfer plan` and `dsinfer probe`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from dsinfer.planner.model_shape import WEIGHT_BYTES


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose TP × PP × DP (× EP) for N devices from a cost model")
    p.add_argument("--model", required=True, help="config.json (or its directory) or an artifact")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--profile", required=True, help="h200 | a100 | ascend-910b | probe JSON")
    p.add_argument("--objective", default="throughput", choices=["latency", "throughput"])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16, help="concurrent sequences in all")
    p.add_argument("--weight-dtype", default=None, choices=sorted(WEIGHT_BYTES))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
    q = sub.add_parser("probe", help="measure this machine into a device profile (JSON)")
    q.add_argument("-o", "--output", default=None, help="write the profile here")
    q.add_argument("--name", default="this-cpu")
    q.set_defaults(func=cmd_probe)


def _model_config(model: str):  # noqa: ANN202
    from dsinfer.artifact.manifest import config_from_dict, read_manifest
    from dsinfer.artifact.verify import is_artifact
    from dsinfer.models.loader import read_model_config, resolve_model_path

    if is_artifact(model):
        manifest = read_manifest(Path(model))
        scheme = manifest.quantization["scheme"]
        dtype = {"int8": "int8", "int4": "int4"}.get(scheme, manifest.quantization["dtype"])
        return config_from_dict(manifest.model_config), dtype
    return read_model_config(resolve_model_path(model, config_only=True)), None


def cmd_plan(args: argparse.Namespace) -> int:
    from dsinfer.planner.cost_model import Workload
    from dsinfer.planner.model_shape import model_shape
    from dsinfer.planner.planner import format_report, plan
    from dsinfer.planner.profiles import load_profile

    cfg, artifact_dtype = _model_config(args.model)
    if args.devices % args.nodes:
        raise ValueError(f"--devices {args.devices} is not a multiple of --nodes {args.nodes}")
    profile = load_profile(args.profile)
    per_node = args.devices // args.nodes
    if profile.shared_host and per_node > profile.devices_per_node:
        # One CPU "device" is one single-threaded process: more than the cores would
        # time-slice, and collectives would wait on descheduled ranks (SmolLM2 tp=3 on 2
        # cores measured 4× slower than one process) — nothing this model predicts.
        raise ValueError(
            f"{args.profile} describes a host with {profile.devices_per_node} cores: plan for "
            f"at most {profile.devices_per_node} devices per node (--devices / --nodes)"
        )
    profile = dataclasses.replace(profile, devices_per_node=per_node)
    weight_dtype = args.weight_dtype or artifact_dtype or "bfloat16"
    shape = model_shape(cfg, Path(args.model).name or args.model)
    work = Workload(context=args.context, batch=args.batch, weight_dtype=weight_dtype)
    report = plan(shape, args.devices, profile, work, args.objective)
    if args.json:
        rows = [
            {
                "plan": str(e.plan),
                "fits": e.fits,
                "memory_per_device": e.memory_per_device,
                "prefill_s": e.prefill_s,
                "tpot_s": e.tpot_s,
                "throughput": e.throughput,
                "breakdown": e.breakdown,
            }
            for e in report.ranked + [r for r, _ in report.refused]
        ]
        chosen = str(report.chosen.plan) if report.chosen else None
        print(json.dumps({"chosen": chosen, "objective": args.objective, "plans": rows}, indent=2))
    else:
        print(format_report(report, shape, args.devices))
    return 0 if report.chosen else 2


def cmd_probe(args: argparse.Namespace) -> int:
    from dsinfer.planner.probe import probe

    profile = probe(args.name)
    text = json.dumps(profile, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    return 0
