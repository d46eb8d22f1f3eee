"""Data plane: one model runner per parallel rank."""
