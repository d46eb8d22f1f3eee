"""The one error type of the artifact layer: a ValueError, so the CLI and server report it."""

from __future__ import annotations


class ArtifactError(ValueError):
    """An artifact cannot be trusted or read; the message names the file and what to do."""
