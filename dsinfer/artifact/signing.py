"""Keys and signatures in the OpenSSF model-signing format (a sigstore bundle: a DSSE envelope
over an in-toto statement listing every file's sha256), so `model_signing verify key` checks
our artifacts too. Keys are EC P-256 in PEM: KEY (private, mode 0600) and KEY.pub.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from dsinfer.artifact.errors import ArtifactError
from dsinfer.artifact.manifest import SIGNATURE
from dsinfer.progress import progress

logger = logging.getLogger(__name__)


def keygen(path: Path) -> tuple[Path, Path]:
    """Write a new EC P-256 private key to `path` and its public key to `path`.pub."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pub_path = path.with_name(path.name + ".pub")
    for p in (path, pub_path):
        if p.exists():
            raise ArtifactError(f"{p} exists; choose another path or remove it first")
    key = ec.generate_private_key(ec.SECP256R1())
    private_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    pub_path.write_bytes(public_pem)
    return path, pub_path


def _hashing_config():  # type: ignore[no-untyped-def]
    from model_signing import hashing

    # The signature file cannot cover itself; everything else in the directory is signed.
    return hashing.Config().use_file_serialization().set_ignored_paths(paths=[SIGNATURE])


def sign_dir(root: Path, key: Path) -> None:
    """Sign every file under `root` into root/model.sig (written aside, then renamed)."""
    from model_signing import signing

    if not key.is_file():
        raise ArtifactError(f"signing key {key} not found; create one with `dsinfer keygen`")
    tmp = root / f".{SIGNATURE}.tmp"
    try:
        cfg = signing.Config().use_elliptic_key_signer(private_key=key)
        # model-signing hashes every file itself: one step, shown while it runs.
        with progress(f"signing {root.name}", 1) as done:
            cfg.set_hashing_config(_hashing_config()).sign(root, tmp)
            done(1)
    except ArtifactError:
        raise
    except Exception as e:  # the library raises several types for a bad key file
        tmp.unlink(missing_ok=True)
        raise ArtifactError(f"cannot sign with {key}: {e} (an EC P-256/P-384 PEM key?)") from None
    os.replace(tmp, root / SIGNATURE)


def verify_signature(root: Path, trusted_keys: Sequence[Path]) -> Path:
    """Return the trusted public key that verifies root/model.sig, or raise naming why."""
    from model_signing import verifying

    sig = root / SIGNATURE
    if not sig.is_file():
        raise ArtifactError(
            f"{root} is unsigned ({SIGNATURE} missing) and a trust policy is in force; "
            "sign it with `dsinfer sign`, or pass --allow-unsigned to load it anyway"
        )
    failures = []
    with progress(f"verifying the signature of {root.name}", len(trusted_keys)) as tried:
        for key in trusted_keys:
            if not key.is_file():
                raise ArtifactError(f"trusted key {key} not found")
            try:
                verifying.Config().use_elliptic_key_verifier(public_key=key).verify(root, sig)
                return key
            except Exception as e:  # invalid signature, wrong key, or a file differs
                failures.append(f"{key.name}: {type(e).__name__}: {e}".rstrip(": "))
            tried(1)
    raise ArtifactError(
        f"{sig}: signature does not verify with any trusted key — " + "; ".join(failures)
    )
