"""manifest.json: what an artifact holds, each file's size and sha256, and its version hash.

The version hash is the sha256 of the manifest's canonical JSON (sorted keys, no whitespace)
without the hash itself, so it changes whenever any file, the config or the quantisation does,
and is the same for two compiles of the same input with the same options.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsinfer.artifact.errors import ArtifactError
from dsinfer.artifact.safe_files import MAX_MANIFEST_BYTES, check_rel_path, read_bounded
from dsinfer.config import ModelConfig, RopeConfig

FORMAT = "dsinfer-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SIGNATURE = "model.sig"
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # POSIX path relative to the artifact root
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    dsinfer_version: str
    model_config: dict[str, Any]
    quantization: dict[str, Any]  # scheme, group_size, dtype, float_layers, tied
    tokenizer_files: list[str]
    weight_files: list[str]
    files: list[FileEntry]
    # Compiled programs (artifact/programs.py): path, device, build target; digested in files.
    programs: list[dict[str, Any]] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    version_hash: str = ""

    @property
    def short_version(self) -> str:
        return self.version_hash[:12]

    def body(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("version_hash")
        data["format"] = FORMAT
        return data

    def sealed(self) -> Manifest:
        return dataclasses.replace(self, version_hash=content_digest(self.body()))


def content_digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entry(root: Path, rel: str) -> FileEntry:
    path = root / rel
    return FileEntry(rel, path.stat().st_size, sha256_file(path))


def write_manifest(root: Path, manifest: Manifest) -> None:
    data = manifest.body()
    data["version_hash"] = manifest.version_hash
    (root / MANIFEST).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_manifest(root: Path) -> Manifest:
    """Parse and self-check manifest.json; any change to it shows as a digest mismatch."""
    path = root / MANIFEST
    if not path.exists() and not path.is_symlink():
        raise ArtifactError(f"{root} is not a dsinfer artifact: {MANIFEST} is missing")
    raw = read_bounded(path, MAX_MANIFEST_BYTES)
    try:
        data = json.loads(raw.decode("utf-8"))
        if data.pop("format") != FORMAT:
            raise ValueError("not a dsinfer artifact manifest")
        stated = data.pop("version_hash")
        files = [FileEntry(**f) for f in data.pop("files")]
        manifest = Manifest(files=files, version_hash=stated, **data)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ArtifactError(
            f"{path}: unreadable manifest ({e}); the file was altered or truncated — "
            "recompile the artifact"
        ) from None
    if manifest.format_version != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: artifact format {manifest.format_version}, this dsinfer reads "
            f"{FORMAT_VERSION}; recompile with this version"
        )
    actual = content_digest(manifest.body())
    if actual != stated:
        raise ArtifactError(
            f"{path}: content digest mismatch (expected {stated}, actual {actual}); "
            "the manifest was altered"
        )
    _check_entries(path, manifest)
    return manifest


def _check_entries(path: Path, manifest: Manifest) -> None:
    """Every path inside the artifact, listed once, with a size and a sha256; the weight and
    tokenizer files among the digested ones."""
    seen: set[str] = set()
    for f in manifest.files:
        check_rel_path(f.path, "files")
        if f.path in seen or f.path in (MANIFEST, SIGNATURE):
            raise ArtifactError(f"{path}: file {f.path} is listed twice; the manifest was altered")
        seen.add(f.path)
        if not isinstance(f.size, int) or isinstance(f.size, bool) or f.size < 0:
            raise ArtifactError(f"{path}: file {f.path} has an invalid size {f.size!r}")
        if not isinstance(f.sha256, str) or len(f.sha256) != 64 or not _is_hex(f.sha256):
            raise ArtifactError(f"{path}: file {f.path} has an invalid sha256 {f.sha256!r}")
    for what, names in (
        ("weight_files", manifest.weight_files),
        ("tokenizer_files", manifest.tokenizer_files),
    ):
        if not isinstance(names, list) or len(set(map(str, names))) != len(names):
            raise ArtifactError(f"{path}: {what} must list each file once")
        for name in names:
            check_rel_path(name, what)
            if name not in seen:
                raise ArtifactError(
                    f"{path}: {what} names {name}, which has no digest in 'files'; every "
                    "file the runtime opens must be digested"
                )
    _check_program_entries(path, manifest.programs, seen)


def _check_program_entries(path: Path, programs: object, digested: set[str]) -> None:
    """The manifest's `programs`: each a digested file with a device and a build target."""
    if not isinstance(programs, list):
        raise ArtifactError(f"{path}: programs must be a list")
    for program in programs:
        if (
            not isinstance(program, dict)
            or not isinstance(program.get("path"), str)
            or not isinstance(program.get("device"), str)
            or not isinstance(program.get("target"), dict)
        ):
            raise ArtifactError(f"{path}: program entry {program!r} is malformed")
        check_rel_path(program["path"], "programs")
        if program["path"] not in digested:
            raise ArtifactError(
                f"{path}: program {program['path']} has no digest in 'files'; every file the "
                "runtime opens must be digested"
            )


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    fields = dict(data)
    fields["rope"] = RopeConfig(**fields["rope"])
    return ModelConfig(**fields)
