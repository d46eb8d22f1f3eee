"""Benchmarks: `dsinfer bench offline|serve`."""
