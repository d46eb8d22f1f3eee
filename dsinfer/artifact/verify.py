"""Verification before load: the manifest, every file's digest, no file added or removed, and
(under a trust policy) the signature. Each refusal names the file, and the expected and actual
digest where there is one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsinfer.artifact.errors import ArtifactError
from dsinfer.artifact.manifest import MANIFEST, SIGNATURE, Manifest, read_manifest, sha256_file
from dsinfer.artifact.signing import verify_signature

logger = logging.getLogger(__name__)
TRUSTED_KEYS_ENV = "DSINFER_TRUSTED_KEYS"


@dataclass(frozen=True, slots=True)
class TrustPolicy:
    """Which public keys an artifact's signature must verify with; none: no policy."""

    trusted_keys: tuple[Path, ...] = ()
    allow_unsigned: bool = False

    @classmethod
    def from_options(cls, keys: Iterable[str] = (), allow_unsigned: bool = False) -> TrustPolicy:
        """--trusted-key values plus DSINFER_TRUSTED_KEYS (paths separated by os.pathsep)."""
        paths = [Path(k).expanduser() for k in keys]
        env = os.environ.get(TRUSTED_KEYS_ENV, "")
        paths += [Path(k).expanduser() for k in env.split(os.pathsep) if k.strip()]
        return cls(tuple(paths), allow_unsigned)

    @property
    def requires_signature(self) -> bool:
        return bool(self.trusted_keys) and not self.allow_unsigned


def is_artifact(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def _listed_files(root: Path) -> set[str]:
    found = set()
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            found.add(Path(dirpath, name).relative_to(root).as_posix())
    return found - {MANIFEST, SIGNATURE}


def check_files(root: Path, manifest: Manifest) -> None:
    """Every listed file present with its size and sha256; nothing unlisted beside them."""
    listed = {f.path for f in manifest.files}
    present = _listed_files(root)
    if missing := sorted(listed - present):
        raise ArtifactError(f"{root}: file {missing[0]} listed in the manifest is missing")
    if extra := sorted(present - listed):
        raise ArtifactError(f"{root}: file {extra[0]} is not in the manifest (added later?)")
    for entry in manifest.files:
        path = root / entry.path
        size = path.stat().st_size
        if size != entry.size:
            raise ArtifactError(
                f"{path}: size {size} bytes, the manifest says {entry.size}; the file was altered"
            )
        actual = sha256_file(path)
        if actual != entry.sha256:
            raise ArtifactError(
                f"{path}: sha256 mismatch (expected {entry.sha256}, actual {actual}); "
                "the file was altered"
            )


def verify_artifact(root: str | Path, policy: TrustPolicy) -> Manifest:
    """Everything an artifact must pass before its first tensor is read."""
    root = Path(root)
    manifest = read_manifest(root)
    check_files(root, manifest)
    if policy.trusted_keys and not policy.allow_unsigned:
        key = verify_signature(root, [Path(k) for k in policy.trusted_keys])
        logger.info("artifact %s signed by trusted key %s", manifest.short_version, key)
    elif (root / SIGNATURE).is_file():
        logger.warning(
            "artifact %s: signature not checked (no trust policy; pass --trusted-key)",
            manifest.short_version,
        )
    return manifest


def verify_signed(root: Path, keys: Sequence[Path]) -> Path:
    """`dsinfer verify`: digests first (clear per-file errors), then the signature."""
    check_files(root, read_manifest(root))
    return verify_signature(root, keys)
