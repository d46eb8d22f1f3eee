"""dsinfer: an inference engine and OpenAI-compatible server for DeepSeek-family models."""

from dsinfer.engine.llm import LLM
from dsinfer.engine.outputs import CompletionOutput, RequestOutput
from dsinfer.sampling import SamplingParams
from dsinfer.version import __version__

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
