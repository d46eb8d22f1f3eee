"""Tool calling on /v1/chat/completions: what the prompt shows, what the output may be, and how
the answer reaches the client (whole, or streamed as OpenAI streams tool calls).

tool_choice:
- "none": tools are not shown and nothing is parsed.
- "auto" (the default with tools): the tools go to the chat template as `tools` (and, for a
  template that knows nothing of tools, into a system message that teaches the hermes
  syntax); the output is parsed in the template's own syntax (server/tool_parsers.py).
- "required": constrained decoding to a JSON array of {"name", "arguments"} over the given
  tools (at most one item without parallel_tool_calls).
- a named function: constrained decoding to that function's parameters; the output is the
  arguments.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dsinfer.server.reasoning import partial_suffix
from dsinfer.server.tool_parsers import ToolCall, ToolParser, parse_required
from dsinfer.structured import StructuredOutputs

_TOJSON_ARGS = re.compile(r"arguments\s*\|\s*tojson")
_TOOLS_VAR = re.compile(r"\btools\b")

FALLBACK_SYSTEM = (
    "You can call functions. The available functions, as JSON schemas:\n{tools}\n\n"
    "To call functions, answer with one block per call and nothing else:\n<tool_call>\n"
    '{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>'
)


def needs_fallback_prompt(template: str | None) -> bool:
    """A template that knows nothing of tools (no tool list, no tool-call turns) gets them
    described in a system message. One that renders tool-call turns but no tool list
    (DeepSeek-V3's) is rendered as transformers renders it: unchanged."""
    text = template or ""
    return not _TOOLS_VAR.search(text) and "tool_calls" not in text


def prepare_messages(messages: list[dict[str, Any]], template: str | None) -> list[dict]:
    """Turns as the template wants them: templates that write `arguments | tojson` take the
    arguments as an object (transformers' convention), the others the OpenAI JSON string; a
    template that knows nothing of tools gets tool-calling turns as hermes text (the syntax
    its fallback prompt teaches)."""
    if needs_fallback_prompt(template):
        return [_fallback_turn(m) for m in messages]
    if not template or not _TOJSON_ARGS.search(template):
        return messages
    out = []
    for msg in messages:
        calls = msg.get("tool_calls")
        if calls:
            msg = dict(msg, tool_calls=[_args_as_object(c) for c in calls])
        out.append(msg)
    return out


def _fallback_turn(msg: dict) -> dict:
    """A turn for a template that knows no tools: calls as hermes text, a tool's result as a
    user turn wrapped in <tool_response> (such templates may refuse a "tool" role)."""
    if msg.get("tool_calls"):
        return _calls_as_text(msg)
    if msg["role"] == "tool":
        rest = {k: v for k, v in msg.items() if k not in ("tool_call_id", "name")}
        return rest | {
            "role": "user",
            "content": f"<tool_response>\n{msg['content']}\n</tool_response>",
        }
    return msg


def _calls_as_text(msg: dict) -> dict:
    blocks = []
    for call in msg["tool_calls"]:
        fn = _args_as_object(call)["function"]
        body = json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")})
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    text = "\n".join([msg["content"], *blocks] if msg.get("content") else blocks)
    return {k: v for k, v in msg.items() if k != "tool_calls"} | {"content": text}


def _args_as_object(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            raise ValueError(
                f"tool call {fn.get('name')!r}: arguments must be a JSON object text"
            ) from None
    return dict(call, function=fn)


def with_fallback_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For a template that knows no tools: describe them in the (first) system message."""
    text = FALLBACK_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [dict(messages[0], content=f"{messages[0]['content']}\n\n{text}"), *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def required_constraint(functions: list[dict], parallel: bool) -> StructuredOutputs:
    """[{"name": one of the functions, "arguments": its parameters}, ...] (≥ 1 item)."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": parameters_of(f)},
            "required": ["name", "arguments"],
        }
        for f in functions
    ]
    item = options[0] if len(options) == 1 else {"anyOf": options}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputs.from_schema(schema)


def parameters_of(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


class ToolOutput:
    """Turns one choice's text into content and tool calls, whole or as stream deltas."""

    def __init__(self, mode: str, parser: ToolParser | None, named: str | None = None) -> None:
        self.mode, self.parser, self.named = mode, parser, named  # mode: auto|required|named
        self._buffer = ""  # auto: text from the call marker on; required: the whole JSON
        self._holding = False
        self._named_opened = False  # the named call's first delta (id, name) is sent
        self._scan = _ArrayScanner()

    # -- whole -----------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "named":
            return None, [ToolCall(self.named or "", text)]
        if self.mode == "required":
            # Every complete item, also when max_tokens cut the array short.
            return None, [call for _, call in _ArrayScanner().feed(text)]
        assert self.parser is not None
        return self.parser.parse(text)

    # -- streamed ----------------------------------------------------------------------------
    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas) for a text delta."""
        if self.mode == "named":
            return "", self._named_delta(delta)
        if self.mode == "required":
            return "", [self._call_deltas(i, c) for i, c in self._scan.feed(delta)]
        return self._auto(delta, final)

    def _named_delta(self, delta: str) -> list[dict]:
        out = []
        if not self._named_opened:
            self._named_opened = True
            out.append({"index": 0, **ToolCall(self.named or "", "").as_openai()})
        if delta:
            out.append({"index": 0, "function": {"arguments": delta}})
        return out

    def _auto(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        """Content until the parser's start marker (a partial marker at the end is held
        back); from the marker on, the text is held and parsed when the output ends."""
        assert self.parser is not None
        content = ""
        if self._holding:
            self._buffer += delta
        else:
            text = self._buffer + delta
            at = text.find(self.parser.start)
            if at >= 0:
                self._holding, self._buffer, content = True, text[at:], text[:at]
            else:
                keep = 0 if final else partial_suffix(text, self.parser.start)
                self._buffer, content = text[len(text) - keep :], text[: len(text) - keep]
        if not final or not self._holding:
            return content, []
        before, calls = self.parser.parse(self._buffer)
        if not calls:
            return content + self._buffer, []  # not calls after all: it was content
        return content + (before or ""), [self._call_deltas(i, c) for i, c in enumerate(calls)]

    @staticmethod
    def _call_deltas(index: int, call: ToolCall) -> dict:
        return {"index": index, **call.as_openai()}


class _ArrayScanner:
    """Finds each complete top-level object of a streamed JSON array (the "required" format)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False
        self.current = ""
        self.count = 0

    def feed(self, text: str) -> list[tuple[int, ToolCall]]:
        done = []
        for ch in text:
            if self.depth >= 2 or (self.depth == 1 and ch == "{"):
                self.current += ch  # the text of the array item being read
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}":
                    for call in parse_required(self.current):
                        done.append((self.count, call))
                        self.count += 1
                    self.current = ""
        return done
