"""Qwen2 (R1-Distill-Qwen): the Llama graph with biases on q, k and v but not on o."""

from __future__ import annotations

from dsinfer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """The config parser sets qkv_bias=True, o_bias=False for this family; the graph is shared."""
