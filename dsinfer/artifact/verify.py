"""Verification before load: the manifest, every file's digest, no file added or removed, and
(under a trust policy) the signature. Each refusal names the file, and the expected and actual
digest where there is one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dsinfer.artifact.errors import ArtifactError
from dsinfer.artifact.manifest import MANIFEST, SIGNATURE, Manifest, read_manifest
from dsinfer.artifact.safe_files import regular_file_size, sha256_regular, walk_entries
from dsinfer.artifact.signing import verify_signature
from dsinfer.progress import progress

logger = logging.getLogger(__name__)
TRUSTED_KEYS_ENV = "DSINFER_TRUSTED_KEYS"
_HASH_THREADS = 4  # files hashed at once, at most (and at most the cores)


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


def check_layout(root: Path, manifest: Manifest) -> None:
    """Before any byte is hashed: every listed file is a regular file inside the artifact with
    the manifest's size, and nothing else is there (no extra file, link, FIFO or device)."""
    present, others = walk_entries(root)
    if others:
        raise ArtifactError(
            f"{root / others[0]}: not a regular file (a link, FIFO or device); an artifact "
            "holds regular files only"
        )
    listed = {f.path for f in manifest.files}
    if missing := sorted(listed - present):
        raise ArtifactError(f"{root}: file {missing[0]} listed in the manifest is missing")
    if extra := sorted(present - listed - {MANIFEST, SIGNATURE}):
        raise ArtifactError(f"{root}: file {extra[0]} is not in the manifest (added later?)")
    for entry in manifest.files:
        size = regular_file_size(root, entry.path)
        if size != entry.size:
            raise ArtifactError(
                f"{root / entry.path}: size {size} bytes, the manifest says {entry.size}; "
                "the file was altered"
            )


def check_digests(root: Path, manifest: Manifest) -> None:
    """Every file's sha256 against the manifest's, several files at a time (hashlib and file
    reads let go of the GIL: DeepSeek-V2-Lite's 9.6 GB artifact took 12.7 s on one core of
    two); a mismatch is reported for the first such file in the manifest's order."""
    workers = max(1, min(len(manifest.files), os.cpu_count() or 1, _HASH_THREADS))
    with (
        progress("verifying digests", sum(e.size for e in manifest.files)) as advance,
        ThreadPoolExecutor(workers, thread_name_prefix="dsinfer-digest") as pool,
    ):
        checked = pool.map(lambda e: _check_digest(root, e), manifest.files)
        for entry, _ in zip(manifest.files, checked, strict=True):
            advance(entry.size)


def _check_digest(root: Path, entry) -> None:  # noqa: ANN001 (a manifest FileEntry)
    path = root / entry.path
    actual = sha256_regular(path, entry.size)
    if actual != entry.sha256:
        raise ArtifactError(
            f"{path}: sha256 mismatch (expected {entry.sha256}, actual {actual}); "
            "the file was altered"
        )


def check_files(root: Path, manifest: Manifest) -> None:
    """Every listed file present, regular, with its size and sha256; nothing else beside."""
    check_layout(root, manifest)
    check_digests(root, manifest)


def verify_artifact(root: str | Path, policy: TrustPolicy) -> Manifest:
    """Everything an artifact must pass before its first tensor is read."""
    root = Path(root)
    manifest = read_manifest(root)
    check_layout(root, manifest)
    if policy.trusted_keys and not policy.allow_unsigned:
        # Signature first: the digests are only worth checking once the manifest is trusted.
        key = _verify_signature_naming_file(root, manifest, policy.trusted_keys)
        logger.info("artifact %s signed by trusted key %s", manifest.short_version, key)
    elif (root / SIGNATURE).is_file():
        logger.warning(
            "artifact %s: signature not checked (no trust policy; pass --trusted-key)",
            manifest.short_version,
        )
    check_digests(root, manifest)
    return manifest


def verify_signed(root: Path, keys: Sequence[Path]) -> Path:
    """`dsinfer verify`: the layout, the signature, then the digests."""
    manifest = read_manifest(root)
    check_layout(root, manifest)
    key = _verify_signature_naming_file(root, manifest, keys)
    check_digests(root, manifest)
    return key


def _verify_signature_naming_file(root: Path, manifest: Manifest, keys: Sequence[Path]) -> Path:
    """The signature check; when it fails, the digests are checked too so that the error
    names the altered file (the signing library does not)."""
    try:
        return verify_signature(root, [Path(k) for k in keys])
    except ArtifactError as sig_error:
        check_digests(root, manifest)  # raises naming the file, if one differs
        raise sig_error from None
