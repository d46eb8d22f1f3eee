"""dsinfer: an inference engine and OpenAI-compatible server for DeepSeek-family models."""

from dsinfer.engine.llm import LLM
from dsinfer.engine.outputs import CompletionOutput, RequestOutput
from dsinfer.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
