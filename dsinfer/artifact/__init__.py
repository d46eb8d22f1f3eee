"""Offline model artifacts: compile (quantise, fuse), manifest and hashes, signing, verified load."""

from dsinfer.artifact.errors import ArtifactError
from dsinfer.artifact.verify import TrustPolicy, is_artifact

__all__ = ["ArtifactError", "TrustPolicy", "is_artifact"]
