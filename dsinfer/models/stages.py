"""What a pipeline stage holds of a decoder-only model, shared by every family: the embedding
and LM head on the first stage only, and which checkpoint tensors belong to another stage."""

from __future__ import annotations

from dsinfer.config import ModelConfig
from dsinfer.distributed.parallel_state import parallel_state
from dsinfer.layers.embedding import LMHead, VocabEmbedding


def stage_embedding(cfg: ModelConfig) -> VocabEmbedding | None:
    """The token embedding, on the first pipeline stage only (the others receive states)."""
    return (
        VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if parallel_state().is_first_stage else None
    )


def stage_lm_head(cfg: ModelConfig, embedding: VocabEmbedding | None) -> LMHead | None:
    """The LM head, on the first stage only: it holds the sampler (and the tied embedding)."""
    if not parallel_state().is_first_stage:
        return None
    return LMHead(cfg.vocab_size, cfg.hidden_size, embedding if cfg.tie_word_embeddings else None)


def skip_other_stage(name: str, num_layers: int) -> bool:
    """A checkpoint tensor another pipeline stage holds: its decoder layers, and the
    embedding and LM head off the first stage."""
    state = parallel_state()
    if name.startswith("model.layers."):
        index = int(name.split(".")[2])
        return index < num_layers and index not in state.stage_layers(num_layers)
    return not state.is_first_stage and name.startswith(("model.embed_tokens.", "lm_head."))
