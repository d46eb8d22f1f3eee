"""Pure-Python control plane: requests, KV block accounting, scheduling, the engine loop."""
