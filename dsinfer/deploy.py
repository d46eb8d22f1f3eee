"""`dsinfer deploy`: the command line over a running server's admin API.

    dsinfer deploy list
    dsinfer deploy load NAME PATH [--label L]        verify, load and warm (weight 0)
    dsinfer deploy weights NAME VERSION=W ...        e.g. abc123=90 def456=10
    dsinfer deploy promote NAME VERSION              all traffic to VERSION
    dsinfer deploy rollback NAME                     the weights before the newest version
    dsinfer deploy unload NAME VERSION               stop routing, drain, free

--url (default http://127.0.0.1:8000) and --admin-key (or DSINFER_ADMIN_KEY) say where and who.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import httpx


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("deploy", help="load, weight, promote, roll back, unload versions")
    d.add_argument("--url", default="http://127.0.0.1:8000")
    d.add_argument("--admin-key", default=os.environ.get("DSINFER_ADMIN_KEY"))
    d.add_argument("--timeout", type=float, default=600.0, help="seconds (a load can be slow)")
    ops = d.add_subparsers(dest="op", required=True)
    ops.add_parser("list")
    load = ops.add_parser("load")
    load.add_argument("name")
    load.add_argument("path")
    load.add_argument("--label", default=None)
    w = ops.add_parser("weights")
    w.add_argument("name")
    w.add_argument("pairs", nargs="+", metavar="VERSION=WEIGHT")
    p = ops.add_parser("promote")
    p.add_argument("name")
    p.add_argument("version")
    r = ops.add_parser("rollback")
    r.add_argument("name")
    u = ops.add_parser("unload")
    u.add_argument("name")
    u.add_argument("version")
    d.set_defaults(func=run)


def _request(args: argparse.Namespace) -> tuple[str, str, Any]:
    base = "/admin/models"
    if args.op == "list":
        return "GET", base, None
    if args.op == "load":
        return "POST", f"{base}/{args.name}/versions", {"path": args.path, "label": args.label}
    if args.op == "weights":
        weights = {}
        for pair in args.pairs:
            version, sep, weight = pair.partition("=")
            try:
                weights[version] = float(weight)
            except ValueError:
                raise ValueError(f"bad weight {pair!r}; write VERSION=WEIGHT") from None
            if not sep:
                raise ValueError(f"bad weight {pair!r}; write VERSION=WEIGHT")
        return "PUT", f"{base}/{args.name}/weights", {"weights": weights}
    if args.op == "promote":
        return "POST", f"{base}/{args.name}/promote", {"version": args.version}
    if args.op == "rollback":
        return "POST", f"{base}/{args.name}/rollback", None
    return "DELETE", f"{base}/{args.name}/versions/{args.version}", None


def run(args: argparse.Namespace) -> int:
    if not args.admin_key:
        raise ValueError("no admin key: pass --admin-key or set DSINFER_ADMIN_KEY")
    method, path, body = _request(args)
    headers = {"Authorization": f"Bearer {args.admin_key}"}
    try:
        r = httpx.request(method, args.url + path, json=body, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {args.url}: {e}") from None
    data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code >= 400:
        message = data.get("error", {}).get("message", r.text) if isinstance(data, dict) else r.text
        raise ValueError(f"{method} {path} → {r.status_code}: {message}")
    print(json.dumps(data, indent=2))
    return 0
