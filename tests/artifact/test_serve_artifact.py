"""`dsinfer serve` on a signed artifact: verified before the first request, version in /v1/models."""

from __future__ import annotations

import shutil

import pytest

from dsinfer.artifact import ArtifactError
from dsinfer.artifact.manifest import read_manifest
from dsinfer.cli import build_parser
from dsinfer.engine_args import engine_config
from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.launch import load_served_models
from tests.server.conftest import running_server


def _load(art, pub):  # noqa: ANN001, ANN202
    """What `dsinfer serve --model tiny=ART --trusted-key PUB` loads."""
    args = build_parser().parse_args(
        ["serve", "--model", f"tiny={art}", "--trusted-key", str(pub), "--num-kv-blocks", "32"]
    )
    return load_served_models(args.model, lambda path: engine_config(args, path))


def test_served_artifact_reports_its_version(tiny_artifacts, keys):
    import openai

    art = tiny_artifacts["int8"]
    models = _load(art, keys[1])
    try:
        with running_server(build_app(models, ServerSettings())) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            listed = client.models.list().data
            version = read_manifest(art).short_version
            assert [m.id for m in listed] == ["tiny", f"tiny@{version}"]
            assert listed[1].model_extra["version"] == version
            out = client.completions.create(model="tiny", prompt="hello", max_tokens=4)
            assert out.usage.completion_tokens >= 1 and out.model == f"tiny@{version}"
    finally:
        for m in models.served():
            m.engine.shutdown()


def test_serve_refuses_an_altered_artifact(tiny_artifacts, keys, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts["int8"], art)
    cfg = art / "tokenizer" / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("true", "false"))  # one byte longer
    with pytest.raises(ArtifactError, match="tokenizer_config.json: size"):
        _load(art, keys[1])
