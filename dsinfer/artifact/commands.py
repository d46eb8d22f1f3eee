"""CLI for artifacts: `dsinfer compile`, `keygen`, `sign`, `verify`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsinfer.artifact.errors import ArtifactError
from dsinfer.layers.quant import INT4_GROUP_SIZES, SCHEMES


def cmd_compile(args: argparse.Namespace) -> int:
    from dsinfer.artifact.compiler import CompileOptions, compile_artifact

    opts = CompileOptions(
        quant=args.quant,
        group_size=args.group_size,
        dtype=args.dtype,
        sign_key=Path(args.sign_key) if args.sign_key else None,
        force=args.force,
    )
    if args.report:
        from dsinfer.artifact.report import compile_with_report

        report = compile_with_report(args.src, Path(args.output), opts, args.kv_budget)
        print(json.dumps(report, indent=2) if args.json else report_text(report))
        return 0
    manifest = compile_artifact(args.src, Path(args.output), opts)
    print(f"{args.output}: version {manifest.short_version} ({manifest.version_hash})")
    return 0


def report_text(report: dict) -> str:
    ops = report["decode_ops_per_layer"]
    lines = [
        f"artifact        {report['artifact']} version {report['version']}",
        f"compile time    {report['compile_seconds']:.1f} s",
        f"decode ops, one decoder layer (torch.profiler): "
        f"{ops['checkpoint_layout']} before fusion → {ops['compiled']} after (reference "
        f"backend) → {ops['compiled_fused']} on the fused backend"
        + (
            f" → {ops['compiled_program']} in the captured program"
            if "compiled_program" in ops
            else ""
        ),
        "decode calls from Python per step (whole model): "
        + ", ".join(f"{k} {v}" for k, v in report["decode_calls_from_python"].items()),
        "weight bytes    "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in report["weight_bytes"].items()),
        f"KV capacity     {report['kv_capacity_tokens']:,} tokens in "
        f"{report['kv_budget_bytes'] / 2**20:.0f} MiB "
        f"({report['kv_bytes_per_token']:,} B/token)",
    ]
    return "\n".join(lines)


def cmd_keygen(args: argparse.Namespace) -> int:
    from dsinfer.artifact.signing import keygen

    private, public = keygen(Path(args.output))
    print(f"private key {private} (keep it secret), public key {public}")
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    from dsinfer.artifact.manifest import read_manifest
    from dsinfer.artifact.signing import sign_dir
    from dsinfer.artifact.verify import check_files

    root = Path(args.artifact)
    manifest = read_manifest(root)
    check_files(root, manifest)  # never sign something already altered
    sign_dir(root, Path(args.key))
    print(f"signed {root} (version {manifest.short_version}) with {args.key}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from dsinfer.artifact.manifest import read_manifest
    from dsinfer.artifact.verify import TrustPolicy, check_files, verify_signed

    root = Path(args.artifact)
    policy = TrustPolicy.from_options(args.trusted_key)
    if not policy.trusted_keys:
        if not args.digests_only:
            raise ArtifactError(
                "no trusted key: pass --trusted-key PUB (or set DSINFER_TRUSTED_KEYS), "
                "or --digests-only to check the files without the signature"
            )
        manifest = read_manifest(root)
        check_files(root, manifest)
        print(f"OK digests {root} version {manifest.version_hash} (signature not checked)")
        return 0
    key = verify_signed(root, policy.trusted_keys)
    manifest = read_manifest(root)
    print(f"OK {root} version {manifest.version_hash} signed by {key}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("compile", help="compile a checkpoint into a signed artifact")
    c.add_argument("src", help="HF directory, .gguf file or 'smollm2'")
    c.add_argument("-o", "--output", required=True, help="artifact directory to create")
    c.add_argument("--quant", default="none", choices=SCHEMES)
    c.add_argument("--group-size", type=int, default=32, help=f"int4 group size {INT4_GROUP_SIZES}")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    c.add_argument("--sign-key", default=None, help="EC private key from `dsinfer keygen`")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    c.add_argument("--report", action="store_true", help="profile ops, bytes and KV capacity")
    c.add_argument("--kv-budget", default="1GiB", help="memory for the report's KV capacity")
    c.add_argument("--json", action="store_true", help="report as JSON")
    c.set_defaults(func=cmd_compile)

    k = sub.add_parser("keygen", help="create an EC P-256 signing key pair")
    k.add_argument("-o", "--output", required=True, help="private key path (KEY.pub beside)")
    k.set_defaults(func=cmd_keygen)

    s = sub.add_parser("sign", help="sign an artifact (replaces an earlier signature)")
    s.add_argument("artifact")
    s.add_argument("--key", required=True)
    s.set_defaults(func=cmd_sign)

    v = sub.add_parser("verify", help="check an artifact's digests and signature")
    v.add_argument("artifact")
    v.add_argument("--trusted-key", action="append", default=[], metavar="PUB")
    v.add_argument("--digests-only", action="store_true")
    v.set_defaults(func=cmd_verify)
