"""Parallel planning: device profiles (data), a cost model, and the plan search."""
