"""One entry point for the engine: an artifact (verified under the trust policy) or a checkpoint."""

from __future__ import annotations

import logging

from dsinfer.artifact.errors import ArtifactError
from dsinfer.artifact.reader import load_artifact
from dsinfer.artifact.verify import TrustPolicy, is_artifact
from dsinfer.models.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)


def load_model_source(
    model: str,
    policy: TrustPolicy,
    dtype: str = "auto",
    device: str = "cpu",
    random_weights: bool = False,
    seed: int = 0,
    enable_mtp: bool = True,
    random_quant: str = "none",
    quantization: str = "auto",
    backend: str = "reference",
) -> LoadedModel:
    if is_artifact(model):
        if random_weights:
            raise ArtifactError(f"{model} is a compiled artifact; --random-weights needs a config")
        if dtype != "auto":
            logger.warning("--dtype %s ignored: an artifact's dtype is fixed at compile", dtype)
        if quantization not in ("auto", "none"):
            logger.warning(
                "--quantization %s ignored: an artifact is quantised at compile", quantization
            )
        return load_artifact(model, policy, device)
    if policy.requires_signature:
        raise ArtifactError(
            f"a trust policy is in force (--trusted-key / DSINFER_TRUSTED_KEYS) and {model!r} "
            "is not a signed artifact: compile and sign it (dsinfer compile … --sign-key KEY), "
            "or pass --allow-unsigned"
        )
    return load_model(
        model,
        dtype,
        device,
        random_weights,
        seed,
        enable_mtp,
        random_quant,
        quantization,
        backend=backend,
    )
