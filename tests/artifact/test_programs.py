"""The compiled program an artifact carries (artifact/programs.py): listed and signed like the
weights, loaded instead of a build on a machine it was built for, skipped with the reason on
any other."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.artifact import ArtifactError
from dsinfer.artifact.manifest import SIGNATURE, read_manifest, write_manifest
from dsinfer.artifact.programs import CPU_LIBRARY
from dsinfer.artifact.signing import sign_dir
from dsinfer.artifact.verify import TrustPolicy, verify_artifact
from dsinfer.layers.kernels.cpu_build import build_target


def test_compiled_artifact_lists_its_program_with_digest_and_target(tiny_artifacts, keys):
    for art in tiny_artifacts.values():
        manifest = read_manifest(art)
        assert manifest.programs == [
            {"path": CPU_LIBRARY, "device": "cpu", "target": build_target()}
        ]
        assert CPU_LIBRARY in {f.path for f in manifest.files}  # hashed, hence signed
        assert (art / CPU_LIBRARY).stat().st_size > 0


def _reseal(art: Path, **changes) -> None:  # noqa: ANN003
    """Rewrite the manifest (sealed anew, signature dropped): what an attacker with no key, or
    a build for another machine, would produce."""
    manifest = read_manifest(art)
    data = json.loads((art / "manifest.json").read_text())
    data.update(changes)
    import dataclasses

    fields = {k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(manifest)}}
    fields["files"] = manifest.files
    write_manifest(art, dataclasses.replace(manifest, **fields).sealed())
    (art / SIGNATURE).unlink(missing_ok=True)


def test_program_built_for_another_torch_is_skipped_with_the_reason(
    tiny_artifacts, tmp_path, caplog, keys
):
    """A signed artifact compiled where torch differs: its program is skipped, saying why."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts["int8"], art)
    target = {**build_target(), "torch": "0.0.0"}
    _reseal(art, programs=[{"path": CPU_LIBRARY, "device": "cpu", "target": target}])
    sign_dir(art, keys[0])
    with caplog.at_level(logging.INFO):
        llm = LLM(str(art), trusted_keys=[str(keys[1])], num_blocks=16, block_size=4)
    assert (
        f"compiled program {CPU_LIBRARY} skipped: built for torch '0.0.0', this machine has "
        f"'{build_target()['torch']}'"
    ) in caplog.text
    assert llm.engine.executor.runner.backend == "fused"  # the kernels built here instead
    out = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("policy", ["allow_unsigned", "no_keys"])
def test_an_unsigned_artifacts_program_never_runs(tiny_artifacts, tmp_path, caplog, policy):
    """Digests alone prove only that the files match a manifest anyone could write: native
    code runs from a trusted signature only; the weights still load."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts["int8"], art)
    if policy == "allow_unsigned":
        (art / SIGNATURE).unlink()
    options = {"allow_unsigned": True} if policy == "allow_unsigned" else {}
    with caplog.at_level(logging.INFO):
        llm = LLM(str(art), num_blocks=16, block_size=4, **options)
    assert f"compiled program {CPU_LIBRARY} skipped: native code runs only from an artifact" in (
        caplog.text
    )
    out = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_program_without_a_digest_is_refused(tiny_artifacts, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts["int8"], art)
    (art / "programs" / "extra.so").write_bytes(b"\x7fELF")
    _reseal(art, programs=[{"path": "programs/extra.so", "device": "cpu", "target": {}}])
    with pytest.raises(ArtifactError, match="program programs/extra.so has no digest"):
        verify_artifact(art, TrustPolicy(allow_unsigned=True))


def test_loading_a_compiled_artifact_compiles_nothing(tiny_artifacts, keys, tmp_path):
    """A fresh process with an empty kernel cache: the kernels and the decode-step program come
    from the artifact (verified and signed), nothing is built, decode steps run captured."""
    cache = tmp_path / "kernel-cache"
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from dsinfer import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_artifacts['int8'])!r}, trusted_keys=[{str(keys[1])!r}],"
        " num_blocks=16, block_size=4)\n"
        "out = llm.generate(['hi'], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))\n"
        "print('tokens', len(out[0].outputs[0].token_ids))\n"
    )
    env = {**os.environ, "DSINFER_KERNEL_CACHE": str(cache)}
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "from the artifact: nothing compiled" in run.stdout
    assert "decode steps run as one captured program" in run.stdout
    assert "building the fused CPU kernels" not in run.stdout + run.stderr
    assert "tokens 3" in run.stdout
    assert not any(cache.rglob("*.so")), "a kernel library was built"
