"""The rule for every file the runtime opens from an artifact: a regular file inside the
artifact, listed once in the manifest, bounded in size, opened without following links.

Without it a manifest could name `../../x.safetensors` or an absolute path (loaded, yet covered
by no digest), a symlink to /dev/zero or a FIFO could hang verification, and a link pointing
outside (a tokenizer config → /etc/passwd) would be followed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from dsinfer.artifact.errors import ArtifactError

MAX_MANIFEST_BYTES = 16 * 1024**2
_CHUNK = 1 << 20


def check_rel_path(rel: object, what: str) -> str:
    """A manifest path must be a plain relative POSIX path that stays inside the artifact."""
    if not isinstance(rel, str) or not rel:
        raise ArtifactError(f"manifest {what} entry {rel!r} is not a file path")
    p = PurePosixPath(rel)
    if (
        p.is_absolute()
        or "\\" in rel
        or "\x00" in rel
        or any(part in ("..", ".", "") for part in rel.split("/"))
    ):
        raise ArtifactError(
            f"manifest {what} entry {rel!r} points outside the artifact (absolute, '..' or an "
            "odd path); every file must be a plain path inside the artifact"
        )
    return rel


def regular_file_size(root: Path, rel: str) -> int:
    """Size of root/rel after checking it is a regular file reached through real directories
    inside root (no symlink at any level); refuses anything else, naming the file."""
    path = root
    for part in rel.split("/"):
        path = path / part
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise ArtifactError(f"{root}: file {rel} listed in the manifest is missing") from None
        if stat.S_ISLNK(st.st_mode):
            raise ArtifactError(
                f"{path}: is a symbolic link; an artifact holds regular files only (links are "
                "never followed)"
            )
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(f"{path}: not a regular file (a device, FIFO or directory?)")
    return st.st_size


def open_regular(path: Path) -> int:
    """A read-only fd that refuses a symlink at the last component and never blocks on a FIFO
    (checked with fstat after opening, so a swap after the layout check is caught too)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot open without following links ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ArtifactError(f"{path}: not a regular file")
    return fd


def read_bounded(path: Path, limit: int) -> bytes:
    """The whole file, refused if it is not regular or is larger than `limit` bytes."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ArtifactError(f"{path}: larger than {limit} bytes; not an artifact file")
    return data


def sha256_regular(path: Path, size: int) -> str:
    """sha256 of exactly `size` bytes (the manifest's); a file that turns out longer or
    shorter is refused rather than read on."""
    import hashlib

    h = hashlib.sha256()
    fd = open_regular(path)
    with os.fdopen(fd, "rb", buffering=0) as f:
        left = size
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
        if left or f.read(1):
            raise ArtifactError(f"{path}: size changed while it was read; the file was altered")
    return h.hexdigest()


def walk_entries(root: Path) -> tuple[set[str], list[str]]:
    """(regular files, other entries: links, FIFOs, devices) under root, relative POSIX
    paths; directory links are reported, never descended."""
    files: set[str] = set()
    others: list[str] = []
    for dirpath, dirs, names in os.walk(root, followlinks=False):
        for name in [*dirs, *names]:
            full = Path(dirpath, name)
            rel = full.relative_to(root).as_posix()
            mode = os.lstat(full).st_mode
            if stat.S_ISREG(mode):
                files.add(rel)
            elif not stat.S_ISDIR(mode):
                others.append(rel)
    return files, sorted(others)
