"""`dsinfer serve`: load the models, build the app, run uvicorn with a graceful shutdown."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from dsinfer.config import EngineConfig
from dsinfer.device.host_memory import limit_malloc_arenas
from dsinfer.device.host_threads import release_openmp_pool
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.engine_args import DEFAULT_MODEL
from dsinfer.models.loader import EMBEDDED_MODELS
from dsinfer.registry.store import ModelRegistry, Version
from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.async_engine import AsyncEngine
from dsinfer.server.reasoning import supports_reasoning
from dsinfer.server.serving import ServedModel

logger = logging.getLogger("dsinfer.serve")

# A model's path → its engine config (the server's engine flags and trust policy applied);
# the command line builds it, so the server never sees argparse.
ConfigFor = Callable[[str], EngineConfig]


@dataclass(frozen=True)
class ServeOptions:
    """What `dsinfer serve` needs besides the engine configs."""

    host: str
    port: int
    models: Sequence[str]  # NAME=PATH or PATH; a NAME given twice loads two versions
    settings: ServerSettings
    shutdown_timeout: float


def parse_model_spec(spec: str) -> tuple[str, str]:
    """ "NAME=PATH" or "PATH" (the name is then the file or directory stem)."""
    if "=" in spec:
        name, path = spec.split("=", 1)
        if not name or not path:
            raise ValueError(f"bad --model {spec!r}; write NAME=PATH or PATH")
        return name, path
    if spec in EMBEDDED_MODELS:
        return spec, spec
    return Path(spec).stem, spec


def version_builder(config_for: ConfigFor) -> Callable[[str, str], ServedModel]:
    """build(name, path) → a loaded ServedModel named NAME@VERSION (NAME for a checkpoint),
    with this server's engine flags and trust policy."""

    def build(name: str, path: str) -> ServedModel:
        config = config_for(path)
        # The engine loads, tunes and steps on its own thread; this one (the main thread at
        # start-up, a worker thread on a hot swap) must then hold no OpenMP pool, or every
        # parallel region there pays a futex wake-up (device/host_threads.py).
        release_openmp_pool()
        runner = AsyncEngine(lambda: LLMEngine(config))  # built on its own thread
        engine = runner.engine
        return ServedModel(
            f"{name}@{engine.version}" if engine.version else name,
            runner,
            engine.tokenizer,
            engine.max_model_len,
            version=engine.version,
            reasoning=supports_reasoning(engine.tokenizer),
            grammars=engine.grammars,
        )

    return build


def load_served_models(specs: Sequence[str], config_for: ConfigFor) -> ModelRegistry:
    """Every --model: a name may be given several times, once per version (the first one given
    takes all traffic; the others load at weight 0 for the admin API to shift)."""
    build = version_builder(config_for)
    registry = ModelRegistry()
    for name, path in [parse_model_spec(s) for s in (specs or [DEFAULT_MODEL])]:
        served = build(name, path)
        registry.add(name, Version.of(served, path))
    return registry


def bind_port(host: str, port: int) -> socket.socket:
    """Take the address before the models load (seconds to minutes), so a clash is reported
    at once rather than after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port} ({e.strerror}); another server may be using it: "
            "stop it or choose another --port"
        ) from None
    sock.set_inheritable(True)
    return sock


def _exit_after_shutdown() -> None:
    """Exit 0 once uvicorn has drained the requests and the engines have stopped (its shutdown
    handlers ran before it re-raised SIGTERM). The process leaves without interpreter
    teardown: native threads of torch.distributed (gloo) and the engine's daemon thread can
    abort a finalising interpreter (seen once as SIGABRT in a two-node run)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve(opts: ServeOptions, config_for: ConfigFor) -> int:
    limit_malloc_arenas()
    sock = bind_port(opts.host, opts.port)
    print(f"dsinfer: {opts.host}:{opts.port} is ours; loading the model(s)…", flush=True)
    registry = load_served_models(opts.models, config_for)
    app = build_app(registry, opts.settings, build_version=version_builder(config_for))

    @app.on_event("shutdown")
    def _stop_engines() -> None:
        for m in registry.served():
            m.engine.shutdown()

    url = f"http://{opts.host}:{opts.port}"
    first = next(iter(registry.entries))
    names = [m.name for m in registry.served()]
    print(
        f"dsinfer: serving {', '.join(names)} at {url}/v1\n"
        f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{first}", "messages": [{{"role": "user", '
        f'"content": "Name the capital of France."}}]}}\'',
        flush=True,
    )
    # uvicorn drains in-flight requests on SIGTERM, then re-raises the signal to the handler
    # that was installed before it: make that one a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: _exit_after_shutdown())
    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=opts.shutdown_timeout
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0
