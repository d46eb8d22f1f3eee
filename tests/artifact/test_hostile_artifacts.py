"""Artifacts crafted to escape verification: every file the runtime opens is a regular file
inside the artifact, listed once, digested and bounded; the rest is refused naming the file,
quickly (no hang on a FIFO or /dev/zero), with and without a trust policy."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsinfer.artifact import ArtifactError
from dsinfer.artifact.manifest import MANIFEST, file_entry, read_manifest, write_manifest
from dsinfer.artifact.reader import load_artifact
from dsinfer.artifact.verify import TrustPolicy, verify_artifact, verify_signed


@pytest.fixture
def art(tiny_artifacts, tmp_path) -> Path:
    copy = tmp_path / "art"
    shutil.copytree(tiny_artifacts["int8"], copy)
    return copy


@contextlib.contextmanager
def deadline(seconds: int = 20) -> Iterator[None]:
    """Fail instead of hanging (the old verifier blocked forever on a FIFO)."""

    def boom(*_: object) -> None:
        raise TimeoutError("verification hung")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _reseal(root: Path, **changes: object) -> None:
    """Rewrite the manifest with `changes` and every file's true digest, as an attacker who
    controls the directory (but not the signing key) can."""
    m = read_manifest(root)
    m = dataclasses.replace(m, **changes)
    entries = [file_entry(root, f.path) if (root / f.path).is_file() else f for f in m.files]
    write_manifest(root, dataclasses.replace(m, files=entries).sealed())


def _refused_everywhere(root: Path, pub: Path, *words: str) -> None:
    with deadline():
        for check in (
            lambda: verify_artifact(root, TrustPolicy()),
            lambda: verify_artifact(root, TrustPolicy((pub,))),
            lambda: verify_signed(root, [pub]),
        ):
            with pytest.raises(ArtifactError) as e:
                check()
            for w in words:
                assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("outside", ["../../x.safetensors", "/tmp/x.safetensors", "a/../../x"])
def test_weight_files_outside_the_artifact_are_refused(art, keys, tmp_path, outside):
    target = tmp_path / "x.safetensors"
    shutil.copy(art / read_manifest(art).weight_files[0], target)
    _reseal(art, weight_files=[outside])
    _refused_everywhere(art, keys[1], outside)


def test_weight_files_without_a_digest_are_refused(art, keys):
    m = read_manifest(art)
    _reseal(art, weight_files=[*m.weight_files, "tokenizer/tokenizer.json.extra"])
    _refused_everywhere(art, keys[1], "no digest")


def test_a_duplicate_manifest_entry_is_refused(art, keys):
    m = read_manifest(art)
    _reseal(art, files=[*m.files, m.files[0]])
    _refused_everywhere(art, keys[1], "listed twice")


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "outside-link", "dir-link"])
def test_links_and_special_files_are_refused_without_hanging(art, keys, tmp_path, kind):
    rel = "tokenizer/tokenizer_config.json"
    victim = art / rel
    victim.unlink()
    if kind == "dev-zero":
        victim.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(victim)
    elif kind == "outside-link":
        victim.symlink_to("/etc/passwd")
    else:  # the whole tokenizer directory swapped for a link to a copy outside
        shutil.copytree(art / "tokenizer", tmp_path / "tok")
        (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
        shutil.rmtree(art / "tokenizer")
        (art / "tokenizer").symlink_to(tmp_path / "tok")
    _refused_everywhere(art, keys[1], "tokenizer")


def test_a_linked_manifest_is_refused(art, keys, tmp_path):
    (tmp_path / "m.json").write_bytes((art / MANIFEST).read_bytes())
    (art / MANIFEST).unlink()
    (art / MANIFEST).symlink_to(tmp_path / "m.json")
    with deadline(), pytest.raises(ArtifactError, match=MANIFEST):
        verify_artifact(art, TrustPolicy())


def _rewrite_header(path: Path, edit) -> None:  # noqa: ANN001
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _first_tensor(header: dict) -> dict:
    return next(v for k, v in header.items() if k != "__metadata__" and not k.startswith("__pad"))


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("truncated", "offsets"),
        ("huge-offset", "offsets"),
        ("negative-offset", "offsets"),
        ("huge-shape", "shape"),
        ("negative-shape", "invalid shape"),
        ("bad-dtype", "dtype"),
        ("header-length", "header length"),
        ("not-json", "unreadable safetensors header"),
    ],
)
def test_malformed_safetensors_with_valid_digests_are_refused_naming_the_file(art, case, words):
    name = read_manifest(art).weight_files[0]
    path = art / name
    edits = {
        "huge-offset": lambda h: _first_tensor(h).update(data_offsets=[0, 2**62]),
        "negative-offset": lambda h: _first_tensor(h).update(data_offsets=[-64, 0]),
        "huge-shape": lambda h: _first_tensor(h).update(shape=[2**40, 2**40]),
        "negative-shape": lambda h: _first_tensor(h).update(shape=[-1, 4]),
        "bad-dtype": lambda h: _first_tensor(h).update(dtype="F8_E9M9"),
    }
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:-4096])
    elif case == "header-length":
        data = path.read_bytes()
        path.write_bytes(struct.pack("<Q", 2**60) + data[8:])
    elif case == "not-json":
        data = bytearray(path.read_bytes())
        data[8:12] = b"\xff\xfe{["
        path.write_bytes(bytes(data))
    else:
        _rewrite_header(path, edits[case])
    _reseal(art)  # the digests are valid: only the structure is hostile
    verify_artifact(art, TrustPolicy())  # the bytes are what the manifest says...
    with deadline(), pytest.raises(ArtifactError) as e:
        load_artifact(art, TrustPolicy())  # ...but loading refuses them cleanly
    assert name in str(e.value) and words in str(e.value), str(e.value)
