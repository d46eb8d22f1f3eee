"""Process groups and collectives; identities when the world is one process."""
