"""Parallel state (world size 1 for now: identity communication)."""
