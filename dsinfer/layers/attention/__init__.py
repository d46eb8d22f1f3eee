"""Attention over the paged KV cache: metadata shared by all layers, and backends."""

from dsinfer.layers.attention.backend import AttentionBackend, AttentionMetadata, PrefillSeq
from dsinfer.layers.attention.torch_paged import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillSeq", "TorchPagedAttention"]
