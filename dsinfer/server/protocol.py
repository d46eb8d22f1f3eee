"""OpenAI request schemas (pydantic) and the mapping to SamplingParams.

Validation errors name the offending field, so the API can answer 400 with `param` set.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from dsinfer.sampling import SEED_MAX, SEED_MIN, SamplingParams
from dsinfer.server.request_fields import screen_fields
from dsinfer.structured import StructuredOutputs
from dsinfer.structured.spec import only_one

MAX_N = 16
MAX_STOP_CHARS = 1000
ROLES = ("system", "user", "assistant", "tool", "developer")


def _whole(v: Any) -> Any:
    """JSON's 16.0 is the integer 16 (so JSON Schema reads it, and so this server's
    /openapi.json describes it); `true` and 16.5 are not integers and stay refused."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def integer(**bounds: int) -> Any:
    """A request's integer field with its bounds (ge, le): strict (no bools, no numeric strings)
    but whole floats taken. The bounds go inside, before the validator, so that /openapi.json
    shows them as minimum and maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]


class RequestModel(BaseModel):
    """Every request model: strict types, as OpenAI's API checks them. In pydantic's default
    (lax) mode `true` is the token id 1, `"yes"` a `stream: true` and `"16"` a max_tokens: a
    client's mistake would run as something it did not ask for (found by schema fuzzing,
    tests/server/test_schema_fuzz.py). Integers still pass where a number is asked for, and
    whole numbers such as 16.0 where an integer is (`integer`)."""

    model_config = ConfigDict(strict=True)


class StreamOptions(RequestModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


MAX_LOGIT_BIAS = 300
MAX_CHOICES = 64
MAX_PREDICTION_PARTS = 64


class JSONSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # `schema` shadows a BaseModel attribute in pydantic: stored as json_schema.
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {name, schema}")
        return self


class TextPart(RequestModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Prediction(RequestModel):
    """OpenAI's predicted output: text the answer is expected to repeat mostly (a file with a
    few edits). Its tokens are drafted and verified (worker/prediction_drafter.py): the answer
    is the same with it or without it, only sooner where it is right."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_PREDICTION_PARTS)]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StructuredOutputsParams(RequestModel):
    """vLLM's structured_outputs: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None


class _Common(RequestModel):
    # allow_inf_nan=False: Infinity/NaN (which Python's json reads) never reach the sampler.
    # extra="forbid" backs up request_fields.screen_fields, which names what is refused and why.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    CHAT: ClassVar[bool] = False

    model: str | None = None
    max_tokens: integer(ge=0) | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: integer(ge=-1) = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: integer(ge=1, le=MAX_N) = 1
    seed: integer(ge=SEED_MIN, le=SEED_MAX) | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    ignore_eos: bool = False
    min_tokens: integer(ge=0) = 0
    user: str | None = Field(default=None, max_length=512)
    best_of: integer(ge=1, le=MAX_N) | None = None
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[integer()] | None = Field(default=None, max_length=64)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured outputs (constrained decoding): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None
    prediction: Prediction | None = None
    truncate_prompt_tokens: integer(ge=1) | None = None

    @classmethod
    def screen(cls, data: dict[str, Any], lenient: bool) -> dict[str, Any]:
        return screen_fields(data, set(cls.model_fields), cls.CHAT, lenient)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        return -1 if v == 0 else v  # vLLM: 0 means off, like -1

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} token biases are allowed")
        for key, bias in v.items():
            if not key.isdigit() or len(key) > 9:
                raise ValueError(f"keys are token ids (decimal strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases are in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 8:
            raise ValueError("at most 8 stop sequences are allowed")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        return stops

    @model_validator(mode="after")
    def _derived_seeds(self) -> _Common:
        # Sample i of n uses seed + i: every one of them must be a valid int64 seed too.
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise ValueError(
                f"seed {self.seed} with n={self.n} derives seeds up to {self.seed + self.n - 1}, "
                f"past the int64 limit {SEED_MAX}; use a smaller seed"
            )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> _Common:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of={self.best_of} with n={self.n}: only best_of equal to n is supported "
                "(no server-side ranking of extra samples); send n alone"
            )
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def num_generations(self) -> int:
        """Engine requests this asks for (admission counts them)."""
        return self.n

    def structured(self) -> tuple[StructuredOutputs | None, str | None]:
        """(the output constraint, the field that asked for it); ValueError when two fields
        ask or the one that asks is malformed."""
        asked: list[tuple[str, StructuredOutputs]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", StructuredOutputs(json_object=True)))
        elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            asked.append(
                ("response_format", StructuredOutputs.from_schema(rf.json_schema.json_schema))
            )
        so = self.structured_outputs
        if so is not None:
            fields = {
                "json": so.json_,
                "json_object": so.json_object or None,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
            }
            kind = only_one(fields, "structured_outputs takes")
            asked.append(("structured_outputs", _constraint(*kind)))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            value = getattr(self, name)
            if value is not None:
                asked.append((name, _constraint(name.removeprefix("guided_"), value)))
        if len(asked) > 1:
            raise ValueError(
                f"{asked[0][0]} and {asked[1][0]} both constrain the output; send one of them"
            )
        return (asked[0][1], asked[0][0]) if asked else (None, None)

    def sampling(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured: StructuredOutputs | None = None,
    ) -> SamplingParams:
        return SamplingParams(
            n=1,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            seed=self.seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
            prediction=self.prediction.text() if self.prediction is not None else None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


def _constraint(kind: str, value: Any) -> StructuredOutputs:
    """One constraint field's value (vLLM's structured_outputs keys and guided_* fields alike)
    as a StructuredOutputs."""
    if kind == "json":
        return StructuredOutputs.from_schema(value)
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "choice":
        return StructuredOutputs(choice=tuple(value))
    return StructuredOutputs(**{kind: value})


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TOOLS = 128


class FunctionDef(RequestModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(RequestModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(RequestModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(RequestModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow")

    # A str checked below (its message lists the roles), described as the enum it is.
    role: str = Field(json_schema_extra={"enum": list(ROLES)})
    content: str | list[dict[str, Any]] | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(ROLES)}")
        return v

    def for_template(self) -> dict[str, Any]:
        """The turn as a chat template reads it: text content, the `developer` role as
        `system` (OpenAI's newer name for it), and the turn's other fields (name, tool_calls,
        tool_call_id, ...) passed through for templates that render them."""
        msg = dict(self.model_extra or {})
        msg["role"] = "system" if self.role == "developer" else self.role
        # An assistant turn that only calls tools has no content: templates test for None.
        keep_none = self.content is None and self.role == "assistant" and msg.get("tool_calls")
        msg["content"] = None if keep_none else self.text()
        return msg

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(
                    f"content part type {part.get('type')!r} is not supported; "
                    "this model reads text only"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    CHAT: ClassVar[bool] = True

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: integer(ge=0) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=20) | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _chat_consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice required or a named function needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names function {choice.function.name!r}, which is not in tools"
            )
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError(
                    "continue_final_message needs add_generation_prompt: false (the final "
                    "assistant message is continued, not answered)"
                )
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message needs a final assistant message")
        return self

    def tool_mode(self) -> str | None:
        """None (no tools, or tool_choice "none"), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_functions(self) -> list[dict[str, Any]]:
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def structured(self) -> tuple[StructuredOutputs | None, str | None]:
        """The base constraints, or the one tool_choice "required" / a named function sets."""
        from dsinfer.server.tools import parameters_of, required_constraint

        spec, param = super().structured()
        mode = self.tool_mode()
        if mode not in ("required", "named"):
            return spec, param
        if spec is not None:
            raise ValueError(f"tool_choice {mode} and {param} both constrain the output")
        functions = self.tool_functions()
        if mode == "required":
            return required_constraint(functions, self.parallel_tool_calls), "tools"
        assert isinstance(self.tool_choice, NamedToolChoice)
        wanted = self.tool_choice.function.name
        chosen = next(f for f in functions if f["name"] == wanted)
        return StructuredOutputs.from_schema(parameters_of(chosen)), "tools"


class CompletionRequest(_Common):
    prompt: str | list[str] | list[integer()] | list[list[integer()]]
    max_tokens: integer(ge=0) | None = 16
    echo: bool = False
    logprobs: integer(ge=0, le=20) | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens(cls, v: Any) -> Any:
        return 16 if v is None else v  # OpenAI: null means the default, 16

    def num_generations(self) -> int:
        return self.n * len(self.prompts())

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[integer()]
