"""The import contracts of pyproject.toml (docs/structure.md): kept by the package, and able to
fail — an upward import in a toy package with the same layering is reported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def test_the_package_keeps_its_contracts():
    r = subprocess.run([LINT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "0 broken" in r.stdout


def test_an_upward_import_or_a_cycle_breaks_them(tmp_path):
    pkg = tmp_path / "toy"
    layers = ["registry", "engine", "artifact", "worker", "models", "layers", "distributed"]
    modules = {
        "__init__": "",
        "cli": "",
        "device": "",
        "server/__init__": "",
        "server/app": "import toy.cli\nimport toy.server.util\n",  # upward: server → cli
        "server/util": "import toy.server.app\n",  # and a cycle between siblings
    } | {name: "" for name in layers}
    for mod, body in modules.items():
        path = pkg / f"{mod}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    config = tmp_path / "contracts.toml"
    text = (ROOT / "pyproject.toml").read_text()
    config.write_text(
        text[text.index("[tool.importlinter]") :]
        .replace('"dsinfer"', '"toy"')
        .replace("dsinfer.", "toy.")
    )
    r = subprocess.run(
        [LINT, "--config", str(config)], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert r.returncode != 0
    assert "toy.server is not allowed to import toy.cli" in r.stdout, r.stdout[-2000:]
    assert "No cycles are allowed in toy.server" in r.stdout, r.stdout[-2000:]
