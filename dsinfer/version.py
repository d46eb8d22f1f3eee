"""The package version, importable without the engine (artifact manifests record it)."""

__version__ = "0.1.0"
