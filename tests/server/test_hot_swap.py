"""Two versions of one model in a running server: load, 10%, 100%, rollback, unload under
continuous streaming load — no failed request, each stream from one version; routing split,
sticky users, pinned versions; admin auth; a tampered or untrusted load changes nothing."""

from __future__ import annotations

import functools
import shutil
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dsinfer.artifact.compiler import CompileOptions, compile_artifact
from dsinfer.artifact.manifest import read_manifest
from dsinfer.artifact.signing import keygen
from dsinfer.cli import build_parser
from dsinfer.engine_args import engine_config
from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.launch import load_served_models, version_builder
from tests.helpers import tiny_llama_dir
from tests.server.conftest import running_server

ADMIN, USER = "admin-key", "user-key"


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two signed artifacts of a tiny model with different weights, a key pair, another key."""
    import torch

    root = tmp_path_factory.mktemp("swap")
    priv, pub = keygen(root / "k")
    other, _ = keygen(root / "other")
    arts = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        src = tiny_llama_dir(root / f"src{seed}")
        arts.append(root / f"v{seed}")
        compile_artifact(str(src), arts[-1], CompileOptions(quant="int8", sign_key=priv))
    foreign = root / "foreign"
    shutil.copytree(arts[1], foreign)
    from dsinfer.artifact.signing import sign_dir

    sign_dir(foreign, other)
    return arts, pub, foreign


@pytest.fixture(scope="module")
def server(versions):
    arts, pub, _ = versions
    args = build_parser().parse_args(
        ["serve", "--model", f"tiny={arts[0]}", "--trusted-key", str(pub)]
        + ["--num-kv-blocks", "256", "--block-size", "4", "--max-num-seqs", "16"]
    )
    config_for = functools.partial(engine_config, args)
    registry = load_served_models(args.model, config_for)
    settings = ServerSettings(api_key=USER, admin_api_key=ADMIN)
    app = build_app(registry, settings, build_version=version_builder(config_for))
    with running_server(app) as url:
        yield url, registry
    for m in registry.served():
        m.engine.shutdown()


def _admin(url: str, method: str, path: str, json=None, key=ADMIN) -> httpx.Response:  # noqa: ANN001
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{url}/admin{path}", json=json, headers=headers, timeout=120)


def _client(url: str):  # noqa: ANN202
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=USER, max_retries=0, timeout=60)


class StreamingLoad:
    """Clients streaming completions back to back until stopped; records every stream."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.client = _client(url)
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.streams: list[set[str]] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                models, finish = set(), None
                for chunk in self.client.completions.create(
                    model="tiny", prompt="w5 w9 w33", max_tokens=8, temperature=0, stream=True
                ):
                    models.add(chunk.model)
                    finish = chunk.choices[0].finish_reason if chunk.choices else finish
                if finish is None:
                    self.failures.append(f"stream ended without finish_reason ({models})")
                self.streams.append(models)
            except Exception as e:  # any failure counts
                self.failures.append(repr(e))

    def __enter__(self) -> StreamingLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def _served_by(client, n: int, user: str | None = None) -> Counter:  # noqa: ANN001
    def one(_: int) -> str:
        r = client.completions.create(
            model="tiny", prompt="w5", max_tokens=1, temperature=0, user=user
        )
        return r.model

    with ThreadPoolExecutor(8) as pool:
        return Counter(pool.map(one, range(n)))


def test_canary_rollout_and_rollback_under_streaming_load(server, versions):
    url, registry = server
    arts, _, _ = versions
    v1 = f"tiny@{read_manifest(arts[0]).short_version}"
    v2 = f"tiny@{read_manifest(arts[1]).short_version}"
    client = _client(url)
    with StreamingLoad(url) as load:
        r = _admin(url, "POST", "/models/tiny/versions", {"path": str(arts[1]), "label": "v2"})
        assert r.status_code == 201, r.text
        assert r.json()["model"] == v2
        assert _served_by(client, 20) == Counter({v1: 20})  # loaded at weight 0

        ids = {v1: v1.split("@")[1], v2: v2.split("@")[1]}
        r = _admin(url, "PUT", "/models/tiny/weights", {"weights": {ids[v1]: 90, "v2": 10}})
        assert r.status_code == 200, r.text
        split = _served_by(client, 400)
        assert set(split) == {v1, v2} and 0.05 <= split[v2] / 400 <= 0.15, split
        for user in (f"user-{i}" for i in range(20)):  # sticky while the weights stand
            assert len(_served_by(client, 5, user)) == 1

        r = _admin(url, "POST", "/models/tiny/promote", {"version": "v2"})
        assert r.status_code == 200
        assert _served_by(client, 20) == Counter({v2: 20})
        pinned = client.completions.create(model=v1, prompt="w5", max_tokens=1)
        assert pinned.model == v1  # a pinned request always gets its version

        r = _admin(url, "DELETE", f"/models/tiny/versions/{ids[v2]}")
        assert r.status_code == 409  # it still takes traffic
        r = _admin(url, "POST", "/models/tiny/rollback")  # to the weights before v2 came
        assert r.status_code == 200 and r.json()["weights"] == {ids[v1]: 1.0, ids[v2]: 0.0}
        assert _served_by(client, 20) == Counter({v1: 20})

        used = 'dsinfer:kv_blocks_used{{model_name="tiny",version="{}"}}'
        assert used.format(ids[v2]) in httpx.get(f"{url}/metrics").text
        r = _admin(url, "DELETE", f"/models/tiny/versions/{ids[v2]}")
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"{url}/metrics").text  # an unloaded version's gauges are gone
        assert used.format(ids[v2]) not in metrics
        assert used.format(ids[v1]) in metrics
    assert not load.failures, load.failures[:3]
    assert len(load.streams) > 20
    assert all(len(models) == 1 for models in load.streams)  # each stream from one version
    seen = Counter(next(iter(m)) for m in load.streams)
    assert seen[v1] and seen[v2], seen
    listed = [m.id for m in client.models.list().data]
    assert listed == ["tiny", v1]
    assert [v["model"] for v in registry.describe()[0]["versions"]] == [v1]


def test_admin_api_refuses_user_key_and_no_key(server):
    url, _ = server
    assert _admin(url, "GET", "/models", key=None).status_code == 401
    r = _admin(url, "GET", "/models", key=USER)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert _admin(url, "GET", "/models").status_code == 200
    # and the user API refuses the admin key
    assert (
        httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).status_code
        == 401
    )


def test_tampered_or_untrusted_load_changes_nothing(server, versions, tmp_path):
    url, registry = server
    arts, _, foreign = versions
    before = registry.describe()
    tampered = tmp_path / "tampered"
    shutil.copytree(arts[1], tampered)
    weights = tampered / read_manifest(tampered).weight_files[0]
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    for path, why in ((tampered, "sha256 mismatch"), (foreign, "model.sig"), (tmp_path, "")):
        r = _admin(url, "POST", "/models/tiny/versions", {"path": str(path)})
        assert r.status_code == 400, r.text
        assert why in r.json()["error"]["message"]
    assert registry.describe() == before


def test_versions_in_responses_headers_metrics_and_errors(server, versions):
    url, _ = server
    arts, _, _ = versions
    v1 = f"tiny@{read_manifest(arts[0]).short_version}"
    headers = {"Authorization": f"Bearer {USER}"}
    body = {"model": "tiny", "prompt": "w5", "max_tokens": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
    assert r.json()["model"] == v1 and r.headers["x-dsinfer-model"] == v1
    r = httpx.post(f"{url}/v1/completions", json={**body, "model": "tiny@nope"}, headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    version = v1.split("@")[1]
    assert f'model_name="tiny",version="{version}"' in httpx.get(f"{url}/metrics").text
    bad = _admin(url, "PUT", "/models/tiny/weights", {"weights": {"tiny": -1}})
    assert bad.status_code in (400, 404)
    assert _admin(url, "POST", "/models/ghost/rollback").status_code == 404


def test_deploy_cli_drives_the_admin_api(server, versions, capsys):
    from dsinfer.cli import main

    url, registry = server
    arts, _, _ = versions
    base = ["deploy", "--url", url, "--admin-key", ADMIN]
    assert main([*base, "load", "tiny", str(arts[1]), "--label", "next"]) == 0
    assert (
        main([*base, "weights", "tiny", "next=1", f"{read_manifest(arts[0]).short_version}=3"]) == 0
    )
    assert main([*base, "list"]) == 0
    listed = capsys.readouterr().out
    assert '"label": "next"' in listed and '"weight": 0.25' in listed
    assert main([*base, "rollback", "tiny"]) == 0
    assert main([*base, "unload", "tiny", "next"]) == 0
    assert [len(e["versions"]) for e in registry.describe()] == [1]
    assert main([*base[:-1], "wrong", "list"]) == 2
    assert "403" in capsys.readouterr().err
