"""The `dsinfer` command line as a user runs it: generate, serve (auth, SIGTERM), errors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.server.conftest import free_port, wait_healthy

DSINFER = [sys.executable, "-m", "dsinfer.cli"]


def test_generate_chat_prints_answer():
    # The exact path (transformers' logits to 1e-4): under int4 + bf16 the first token is a
    # tie ("L" and "The" both at −1.932 in the reference), so the answer there is a coin flip.
    r = subprocess.run(
        [
            *DSINFER,
            "generate",
            "--model",
            "smollm2",
            "--prompt",
            "What is the capital of France?",
            "--chat",
            "--max-tokens",
            "20",
            "--kv-cache-memory",
            "64MiB",
            "--dtype",
            "float32",
            "--quantization",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."


def test_bad_model_is_a_message_not_a_traceback(tmp_path):
    r = subprocess.run(
        [*DSINFER, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "not found" in r.stderr and "Traceback" not in r.stderr


def test_serve_auth_vllm_spelling_and_graceful_sigterm():
    """`dsinfer serve MODEL --served-model-name NAME -tp 1 --dtype float16`, as with vLLM, with
    a key; an in-flight request survives SIGTERM."""
    port = free_port()
    proc = subprocess.Popen(
        [*DSINFER, "serve", "smollm2", "--served-model-name", "smol", "-tp", "1",
         "--dtype", "float16", "--port", str(port), "--kv-cache-memory", "64MiB",
         "--api-key", "k1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy(),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc])
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert (
            httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 401
        )
        h = {"Authorization": "Bearer k1"}
        models = httpx.get(f"{url}/v1/models", headers=h).json()
        assert [m["id"] for m in models["data"]] == ["smol"]
        body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        chat = httpx.post(f"{url}/v1/chat/completions", json=body, headers=h, timeout=60)
        assert chat.status_code == 200
        # An in-flight request survives SIGTERM; the server then exits on its own.
        result: dict = {}

        def long_request() -> None:
            r = httpx.post(
                f"{url}/v1/completions",
                headers=h,
                timeout=60,
                json={"prompt": "Once", "max_tokens": 120, "ignore_eos": True},
            )
            result["status"] = r.status_code
            result["tokens"] = r.json()["usage"]["completion_tokens"]

        t = threading.Thread(target=long_request)
        t.start()
        # SIGTERM only once the request is running, however slow the machine.
        running = 'dsinfer:num_requests_running{model_name="smol",version=""} 1.0'
        deadline = time.monotonic() + 30
        while running not in httpx.get(f"{url}/metrics").text:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert result == {"status": 200, "tokens": 120}
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        assert f"serving smol at {url}/v1" in out and "curl" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_port_clash_is_reported_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A model that does not exist: the port error must come first, before any loading.
        r = subprocess.run(
            [*DSINFER, "serve", str(tmp_path / "missing"), "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    assert "Traceback" not in r.stderr


def test_python_m_and_version(capsys):
    r = subprocess.run(
        [sys.executable, "-m", "dsinfer", "--version"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.startswith("dsinfer ") and "torch" in r.stdout
    # Option clashes are a message and exit 2 (in-process: the same main as the script's).
    from dsinfer.cli import main

    assert main(["serve", "a", "--model", "b", "--served-model-name", "x"]) == 2
    assert "--served-model-name names one model" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "-tp", "2", "--parallel", "tp=2"]) == 2
    assert "give the grid once" in capsys.readouterr().err
