"""The shapes of the server's answers other than errors (openapi.ErrorResponse), for
/openapi.json only: the routes build their
bodies as dicts (server/chat.py, completions.py, serving.py, api.py) and these models describe
them, field for field (extra="forbid": a field the description lacks is a fuzzing failure,
tests/server/test_schema_fuzz.py). Streams are not described here: their chunks are events."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# engine/outputs.py's reasons, and "tool_calls" for a message that calls tools.
FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PredictionTokens(_Shape):
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(_Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Speculative decoding: the drafted tokens the model verified (OpenAI's predicted outputs).
    completion_tokens_details: PredictionTokens | None = None


class CompletionLogprobs(_Shape):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class Completion(_Shape):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Shape):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Shape):
    content: list[TokenLogprob]


class FunctionCall(_Shape):
    name: str
    arguments: str  # JSON text, as OpenAI's


class ToolCall(_Shape):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Shape):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # R1-style models: the text inside the think block
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Shape):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(_Shape):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    version: str | None
    weights: dict[str, float] | None = None  # a routable name: its versions' traffic weights
    label: str | None = None  # NAME@VERSION: its label and the name it serves under
    root: str | None = None


class ModelList(_Shape):
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(_Shape):
    tokens: list[int]
    count: int
    max_model_len: int


class Detokenized(_Shape):
    prompt: str


class EngineHealth(_Shape):
    state: Literal["ok", "restarting", "dead"]  # AsyncEngine.state
    restarts: int
    last_fault: str | None


class Health(_Shape):
    """/health: 200 while every engine serves, 503 while one restarts or after one stopped."""

    status: Literal["ok", "restarting", "error"]
    engines: dict[str, EngineHealth]
    dead: list[str] | None = None
