"""Model families and checkpoint loading."""
