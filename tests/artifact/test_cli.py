"""`dsinfer keygen | compile | sign | verify` as a user runs them: messages, not tracebacks."""

from __future__ import annotations

from dsinfer.cli import main


def test_keygen_compile_sign_verify(tmp_path, tiny_src, capsys):
    key = tmp_path / "k"
    assert main(["keygen", "-o", str(key)]) == 0
    assert (tmp_path / "k.pub").is_file() and (key.stat().st_mode & 0o777) == 0o600
    out = tmp_path / "art"
    assert main(["compile", str(tiny_src), "-o", str(out), "--quant", "int8"]) == 0
    assert "version" in capsys.readouterr().out
    # Unsigned: verifying against a key fails with a message; digests alone pass.
    assert main(["verify", str(out), "--trusted-key", f"{key}.pub"]) == 2
    assert "unsigned" in capsys.readouterr().err
    assert main(["verify", str(out), "--digests-only"]) == 0
    assert main(["sign", str(out), "--key", str(key)]) == 0
    capsys.readouterr()
    assert main(["verify", str(out), "--trusted-key", f"{key}.pub"]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["verify", str(out)]) == 2
    assert "no trusted key" in capsys.readouterr().err


def test_compile_errors_are_messages(tmp_path, tiny_src, capsys):
    out = tmp_path / "art"
    assert main(["compile", str(tiny_src), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["compile", str(tiny_src), "-o", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["compile", str(tiny_src), "-o", str(out), "--force"]) == 0
    bad = ["compile", str(tiny_src), "-o", str(tmp_path / "b"), "--quant", "int4"]
    assert main([*bad, "--group-size", "48"]) == 2
    assert "--group-size 48" in capsys.readouterr().err
    assert main(["compile", str(tmp_path / "nowhere"), "-o", str(tmp_path / "c")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["keygen", "-o", str(tmp_path / "k")]) == 0
    assert main(["keygen", "-o", str(tmp_path / "k")]) == 2
    assert "exists" in capsys.readouterr().err


def test_generate_from_artifact_with_trust_policy(tmp_path, tiny_artifacts, keys, capsys):
    art = str(tiny_artifacts["none"])
    argv = ["generate", "--model", art, "--prompt", "hello", "--max-tokens", "3"]
    assert main([*argv, "--trusted-key", str(keys[1]), "--num-kv-blocks", "16"]) == 0
    assert main([*argv, "--trusted-key", str(tmp_path / "missing.pub")]) == 2
    assert "missing.pub" in capsys.readouterr().err


def test_compile_report_is_measured(tmp_path, tiny_src, capsys):
    import json

    out = tmp_path / "art"
    argv = ["compile", str(tiny_src), "-o", str(out), "--quant", "int8", "--report", "--json"]
    assert main([*argv, "--kv-budget", "1MiB"]) == 0
    report = json.loads(capsys.readouterr().out)
    ops = report["decode_ops_per_layer"]
    # Fusing q/k/v and gate/up removes at least one matmul and one concat per fused group.
    assert ops["compiled"] <= ops["checkpoint_layout"] - 4 and ops["compiled"] > 10
    # The fused backend: norm+residual, qkv, rotary+cache write+attention, o, norm+residual,
    # gate|up, SiLU·mul, down — and the slice that picks the decode rows.
    assert ops["compiled_fused"] <= ops["compiled"] / 5, ops
    # The captured program runs the same kernels without the slice: 8 (the tiny model's int8
    # layers are narrow, so their matmul is torch's packed kernel: aten, counted too).
    assert ops["compiled_program"] == 8, ops
    calls = report["decode_calls_from_python"]
    # Python calls the embedding and the program once a step, whatever the depth.
    assert calls["compiled_program"] <= 3 < calls["compiled_fused"] < calls["compiled"], calls
    wb = report["weight_bytes"]
    assert wb["int4"] < wb["int8"] < wb["bfloat16"] < wb["float32"]
    per_token = report["kv_bytes_per_token"]
    assert per_token == 2 * 2 * 2 * 8 * 2  # K and V × layers × kv heads × head dim × bf16
    assert report["kv_capacity_tokens"] == (1 << 20) // (per_token * 16) * 16


def test_openssf_tool_verifies_our_signature(tiny_artifacts, keys, other_keys):
    import subprocess
    import sys

    art = tiny_artifacts["int4"]

    def verify(pub) -> int:  # noqa: ANN001
        cmd = [sys.executable, "-m", "model_signing", "verify", "key", str(art)]
        cmd += ["--signature", str(art / "model.sig"), "--public_key", str(pub)]
        return subprocess.run(cmd, capture_output=True).returncode

    assert verify(keys[1]) == 0
    assert verify(other_keys[1]) != 0
