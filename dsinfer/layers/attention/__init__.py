"""Attention over the paged KV cache: metadata shared by all layers, and backends.

Importing this package registers every backend (reference MHA, MLA and sparse MLA, fused CPU
MHA and MLA, fused CUDA MHA)."""

from dsinfer.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    MHABackend,
    PrefillSeq,
)
from dsinfer.layers.attention.fused_cpu import FusedCpuMLAAttention, FusedCpuPagedAttention
from dsinfer.layers.attention.mla import MLAPagedAttention
from dsinfer.layers.attention.registry import attention_class, make_attention
from dsinfer.layers.attention.sdpa_paged import SdpaPagedAttention
from dsinfer.layers.attention.sparse_mla import IndexQuery, SparseMLAPagedAttention
from dsinfer.layers.attention.torch_paged import TorchPagedAttention

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "IndexQuery",
    "FusedCpuMLAAttention",
    "FusedCpuPagedAttention",
    "MHABackend",
    "MLAPagedAttention",
    "PrefillSeq",
    "SdpaPagedAttention",
    "SparseMLAPagedAttention",
    "TorchPagedAttention",
    "attention_class",
    "make_attention",
]
