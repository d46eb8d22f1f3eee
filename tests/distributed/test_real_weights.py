"""The grid with the real SmolLM2 weights: tensor parallel over 3 ranks (its 9 heads and 3 KV
heads, a tied vocabulary of 49,152 split in three) in-process, and a two-node server — two
`dsinfer serve` processes joined by the rendezvous flags — answering the real openai client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dsinfer import LLM, SamplingParams
from tests.server.conftest import free_port, wait_healthy

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


@pytest.mark.slow  # multi-process: make test-slow
def test_smollm2_tp3_split_vocabulary_answers_like_one_process():
    llm = LLM("smollm2", dtype="float32", kv_cache_memory="64MiB", tensor_parallel=3)
    try:
        model = llm.engine.executor.runner.model
        assert model.model.embed_tokens.weight.shape[0] == 49152 // 3
        assert model.model.layers[0].self_attn.h == 3
        out = llm.chat([QUESTION], SamplingParams(temperature=0, max_tokens=20))
        assert out[0].outputs[0].text.strip() == ANSWER
    finally:
        llm.engine.shutdown()


def _serve(port: int, master_port: int, node_rank: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "dsinfer.cli", "serve", "--port", str(port)]
    argv += ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--parallel", "pp=2"]
    argv += ["--nnodes", "2", "--node-rank", str(node_rank)]
    argv += ["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
    )


@pytest.mark.slow  # multi-process: make test-slow
def test_two_node_server_answers_the_openai_client_and_stops_cleanly():
    from openai import OpenAI

    port, master_port = free_port(), free_port()
    node1 = _serve(port, master_port, 1)  # may start first: it waits at the rendezvous
    node0 = _serve(port, master_port, 0)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [node0, node1], seconds=120)
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        r = client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=20, temperature=0
        )
        assert r.choices[0].message.content.strip() == ANSWER
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(60) == 0, node0.stdout.read()[-4000:]
        assert node1.wait(60) == 0, node1.stdout.read()  # its ranks left when node 0 stopped
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
