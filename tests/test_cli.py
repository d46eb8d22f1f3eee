"""The `dsinfer` command line as a user runs it: generate, serve (auth, SIGTERM), errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.server.conftest import free_port, wait_healthy

DSINFER = [sys.executable, "-m", "dsinfer.cli"]


def test_generate_chat_prints_answer():
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


def test_serve_auth_and_graceful_sigterm():
    port = free_port()
    proc = subprocess.Popen(
        [
            *DSINFER,
            "serve",
            "--port",
            str(port),
            "--api-key",
            "k1",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "64MiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ.copy(),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc])
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert (
            httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 401
        )
        h = {"Authorization": "Bearer k1"}
        assert httpx.get(f"{url}/v1/models", headers=h).status_code == 200
        # An in-flight request survives SIGTERM; the server then exits on its own.
        result: dict = {}

        def long_request() -> None:
            r = httpx.post(
                f"{url}/v1/completions",
                headers=h,
                timeout=60,
                json={"prompt": "Once", "max_tokens": 60, "ignore_eos": True},
            )
            result["status"] = r.status_code
            result["tokens"] = r.json()["usage"]["completion_tokens"]

        t = threading.Thread(target=long_request)
        t.start()
        # SIGTERM only once the request is running, however slow the machine.
        running = 'dsinfer_num_requests_running{model="smollm2"} 1'
        deadline = time.monotonic() + 30
        while running not in httpx.get(f"{url}/metrics").text:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert result == {"status": 200, "tokens": 60}
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        assert f"serving smollm2 at {url}/v1" in out and "curl" in out
    finally:
        if proc.poll() is None:
            proc.kill()
