"""Artifacts shared by the artifact tests: a key pair, a tiny HF checkpoint, compiled SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsinfer.artifact.compiler import CompileOptions, compile_artifact
from dsinfer.artifact.signing import keygen
from tests.helpers import tiny_llama_dir


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    return keygen(tmp_path_factory.mktemp("keys") / "signing.key")


@pytest.fixture(scope="session")
def other_keys(tmp_path_factory) -> tuple[Path, Path]:
    return keygen(tmp_path_factory.mktemp("other-keys") / "other.key")


@pytest.fixture(scope="session")
def tiny_src(tmp_path_factory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-hf"))


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory, tiny_src, keys) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-artifacts")
    out = {}
    for quant in ("none", "bf16", "int8", "int4"):
        out[quant] = root / quant
        compile_artifact(str(tiny_src), out[quant], CompileOptions(quant=quant, sign_key=keys[0]))
    return out


class _Compiled(dict):
    """quant → the signed SmolLM2 artifact, compiled on first use (the fp32 one writes 540 MB
    and only make test-slow reads it)."""

    def __init__(self, root: Path, key: Path) -> None:
        super().__init__()
        self.root, self.key = root, key

    def __missing__(self, quant: str) -> Path:
        out = self.root / quant
        compile_artifact("smollm2", out, CompileOptions(quant=quant, sign_key=self.key))
        self[quant] = out
        return out


@pytest.fixture(scope="session")
def smol_artifacts(tmp_path_factory, keys) -> dict[str, Path]:
    return _Compiled(tmp_path_factory.mktemp("smol-artifacts"), keys[0])
