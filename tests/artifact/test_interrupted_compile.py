"""A compile killed mid-write leaves nothing at OUT; the next compile cleans up after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dsinfer.artifact.compiler import CompileOptions, compile_artifact
from dsinfer.artifact.verify import is_artifact


def _partial_weights(parent, name):  # noqa: ANN001, ANN202
    for d in parent.glob(f".{name}.partial-*"):
        for f in d.glob("*.safetensors"):
            if f.stat().st_size > 1 << 20:
                return f
    return None


def test_killed_compile_leaves_no_artifact(tmp_path, tiny_src):
    out = tmp_path / "smol-art"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsinfer.cli", "compile", "smollm2", "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while _partial_weights(tmp_path, out.name) is None:
            assert proc.poll() is None, "compile ended before it was caught writing"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)  # mid-write: no handler, no cleanup can run
    finally:
        proc.wait()
    assert not out.exists()
    assert not is_artifact(out)
    assert list(tmp_path.glob(f".{out.name}.partial-*")), "the killed compile's scratch dir"
    # The next compile into the same place removes the dead one's leftovers and completes.
    compile_artifact(str(tiny_src), out, CompileOptions())
    assert is_artifact(out)
    assert not list(tmp_path.glob(f".{out.name}.partial-*"))
