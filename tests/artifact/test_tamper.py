"""One flipped bit anywhere, a file added or removed, a wrong key: refused at verify and at load."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsinfer import LLM
from dsinfer.artifact import ArtifactError
from dsinfer.artifact.manifest import MANIFEST, SIGNATURE, read_manifest
from dsinfer.artifact.programs import CPU_LIBRARY
from dsinfer.artifact.signing import sign_dir
from dsinfer.artifact.verify import TrustPolicy, verify_artifact, verify_signed


@pytest.fixture
def art(tiny_artifacts, tmp_path) -> Path:
    copy = tmp_path / "art"
    shutil.copytree(tiny_artifacts["int8"], copy)
    return copy


def _flip(path: Path, where: str) -> None:
    data = bytearray(path.read_bytes())
    index = {"first": 0, "middle": len(data) // 2, "last": len(data) - 1}[where]
    data[index] ^= 0x01
    path.write_bytes(bytes(data))


def _refused(art: Path, pub: Path, name: str) -> None:
    with pytest.raises(ArtifactError, match=name):
        verify_signed(art, [pub])
    with pytest.raises(ArtifactError, match=name):
        LLM(str(art), trusted_keys=[str(pub)], num_blocks=16, block_size=4)


def _weights(art: Path) -> str:
    return read_manifest(art).weight_files[0]


def test_untouched_artifact_verifies(art, keys):
    assert verify_signed(art, [keys[1]]) == keys[1]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_bit_in_weights_is_refused_naming_file_and_digests(art, keys, where):
    name = _weights(art)
    expected = next(f.sha256 for f in read_manifest(art).files if f.path == name)
    _flip(art / name, where)
    _refused(art, keys[1], name)
    with pytest.raises(ArtifactError, match=f"expected {expected}, actual [0-9a-f]{{64}}"):
        verify_signed(art, [keys[1]])
    # Digests are checked with no trust policy too: integrity is not optional.
    with pytest.raises(ArtifactError, match=name):
        verify_artifact(art, TrustPolicy(allow_unsigned=True))


@pytest.mark.parametrize(
    "rel",
    [MANIFEST, "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", CPU_LIBRARY],
)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_bit_in_manifest_tokenizer_or_program_is_refused(art, keys, rel, where):
    _flip(art / rel, where)
    _refused(art, keys[1], Path(rel).name)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_bit_in_signature_is_refused(art, keys, where):
    _flip(art / SIGNATURE, where)
    _refused(art, keys[1], SIGNATURE)


def test_wrong_trusted_key_is_refused(art, other_keys):
    _refused(art, other_keys[1], SIGNATURE)


def test_resigned_by_another_key_is_refused(art, keys, other_keys):
    sign_dir(art, other_keys[0])
    _refused(art, keys[1], SIGNATURE)
    assert verify_signed(art, [keys[1], other_keys[1]]) == other_keys[1]


def test_added_file_is_refused(art, keys):
    (art / "extra.safetensors").write_bytes(b"not in the manifest")
    _refused(art, keys[1], "extra.safetensors")


def test_removed_file_is_refused(art, keys):
    (art / "tokenizer" / "tokenizer_config.json").unlink()
    _refused(art, keys[1], "tokenizer_config.json")


def test_unsigned_artifact_needs_the_opt_out_under_a_policy(art, keys):
    (art / SIGNATURE).unlink()
    _refused(art, keys[1], "unsigned")
    llm = LLM(
        str(art), trusted_keys=[str(keys[1])], allow_unsigned=True, num_blocks=16, block_size=4
    )
    assert llm.engine.version == read_manifest(art).short_version


def test_raw_checkpoint_is_refused_under_a_policy(tiny_src, keys):
    with pytest.raises(ValueError, match="not a signed artifact"):
        LLM(str(tiny_src), trusted_keys=[str(keys[1])], num_blocks=16, block_size=4)


def test_policy_from_environment(art, keys, other_keys, monkeypatch):
    monkeypatch.setenv("DSINFER_TRUSTED_KEYS", str(other_keys[1]))
    with pytest.raises(ArtifactError, match=SIGNATURE):
        LLM(str(art), num_blocks=16, block_size=4)
    monkeypatch.setenv("DSINFER_TRUSTED_KEYS", f"{other_keys[1]}:{keys[1]}")
    LLM(str(art), num_blocks=16, block_size=4)
