"""Compiled programs inside an artifact: the built fused-kernel library with its decode-step
program (layers/kernels/step_program.cpp), so that loading the artifact compiles nothing.

`dsinfer compile` copies the library this machine built into `programs/<device>/` and records
what it was built for (torch version, kernel sources, compiler flags, CPU feature set) in the
manifest's `programs`; the file is listed with its sha256 and covered by the signature like a
weight file, so a changed bit is refused at verification, naming it. It is native code: it is
loaded only from an artifact whose signature verified under a trust policy (an unsigned one's
program is skipped, saying so), after the whole artifact verified, from a private copy of the
very bytes that were hashed (a swap of the file after verification cannot slip in).

A program built for another target is skipped with the reason logged, and the kernels are
built here as without an artifact (or the backend falls back, saying why): never a crash,
never silently slow.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dsinfer.artifact.errors import ArtifactError
from dsinfer.artifact.manifest import Manifest
from dsinfer.artifact.safe_files import read_bounded
from dsinfer.layers.kernels.cpu_build import (
    build_target,
    kernels_loaded,
    load_cpu_ops,
    load_prebuilt,
    loaded_library,
    target_mismatch,
)

logger = logging.getLogger(__name__)
CPU_LIBRARY = "programs/cpu/dsinfer_cpu_ops.so"
MAX_PROGRAM_BYTES = 256 * 1024**2


def write_programs(root: Path) -> list[dict[str, Any]]:
    """Copy this machine's built kernel library into the artifact being written; the
    manifest's `programs` entries (none when the kernels cannot be built here)."""
    why_not = load_cpu_ops()
    library = loaded_library()
    if why_not or library is None:
        logger.warning(
            "the artifact carries no compiled program (%s): loading it will build the "
            "kernels once per machine",
            why_not or "the kernels were loaded from an unknown file",
        )
        return []
    dst = root / CPU_LIBRARY
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(library, dst)
    return [{"path": CPU_LIBRARY, "device": "cpu", "target": build_target()}]


def use_programs(root: Path, manifest: Manifest, device_type: str, signed: bool) -> bool:
    """Load the artifact's program for `device_type` when it was built for this machine
    (after `verify_artifact`). True when the kernels now come from the artifact.

    `signed`: the artifact's signature verified under a trust policy. Weights are data, a
    program is native code: without a trusted signature the digests only prove that the files
    match a manifest anyone could have written, so an unsigned artifact's program never runs."""
    digests = {f.path: (f.size, f.sha256) for f in manifest.files}
    for program in manifest.programs:
        if program["device"] != device_type:
            continue
        rel = program["path"]
        if not signed:
            logger.warning(
                "compiled program %s skipped: native code runs only from an artifact whose "
                "signature verified under --trusted-key; the fused kernels are built here",
                rel,
            )
            return False
        if why_not := target_mismatch(program["target"]):
            logger.warning(
                "compiled program %s skipped: %s; the fused kernels are built here instead "
                "(once per machine), or the reference backend runs",
                rel,
                why_not,
            )
            return False
        if kernels_loaded():  # a second model in this process: its kernels are there already
            logger.info("compiled program %s not needed: the kernels are loaded", rel)
            return False
        data = read_bounded(root / rel, MAX_PROGRAM_BYTES)
        size, sha256 = digests[rel]
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            raise ArtifactError(f"{root / rel}: changed after verification; the file was altered")
        private_dir = Path(tempfile.mkdtemp(prefix="dsinfer-program-"))  # 0700, ours alone
        private = private_dir / Path(rel).name
        try:
            private.write_bytes(data)
            why_not = load_prebuilt(private, program["target"])
        finally:  # once loaded, the mapping outlives the file
            shutil.rmtree(private_dir, ignore_errors=True)
        if why_not:
            logger.info("compiled program %s not loaded: %s", rel, why_not)
            return False
        logger.info("fused kernels and the decode-step program from the artifact: nothing compiled")
        return True
    return False
