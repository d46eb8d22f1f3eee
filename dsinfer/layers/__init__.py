"""nn.Module building blocks shared by every model family."""
