"""Reading tool calls out of what a model wrote, in each family's own syntax.

- deepseek_v3 (DeepSeek-V3/R1 and their distills): <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>
  function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>
  (DeepSeek-V3.1 writes NAME<｜tool▁sep｜>ARGS inside each call)
- hermes (Qwen2/2.5, and our fallback for templates that know no tools): <tool_call>\\n{"name":
  NAME, "arguments": ARGS}\\n</tool_call>, once per call
- llama3_json (Llama 3.1+): the whole answer is {"name": NAME, "parameters": ARGS}, calls
  separated by ";"

Each parser returns (content before the calls or None, calls); text that does not parse as a
call stays content, so a model that writes a malformed call is answered as text, not as an
error. The constrained formats of tool_choice "required" (a JSON array of {name, arguments})
and a named function (the arguments object itself) are read by `parse_required` / the caller.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _json_args(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


class ToolParser:
    name = "base"
    start = ""  # the text that opens the calls (streaming holds it back until sure)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the content before the calls, or None; the calls) — or (text, []) when the text
        holds no well-formed call."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = self._calls(text, at)
        if not calls:
            return text, []
        return (text[:at].rstrip() or None), calls

    def _calls(self, text: str, at: int) -> list[ToolCall] | None:
        """The calls written from `at` on; None (or []) when any of them is malformed."""
        raise NotImplementedError


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    start = "<｜tool▁calls▁begin｜>"
    # V3/R1: TYPE<sep>NAME\n```json\nARGS\n```; V3.1: NAME<sep>ARGS.
    _call = re.compile(
        r"<｜tool▁call▁begin｜>(?:(?P<type>[^<]*?)<｜tool▁sep｜>(?P<name>[^\n<]+)\n```(?:json)?\n"
        r"(?P<args>.*?)\n```|(?P<name31>[^<]+?)<｜tool▁sep｜>(?P<args31>.*?))\s*<｜tool▁call▁end｜>",
        re.DOTALL,
    )

    def _calls(self, text: str, at: int) -> list[ToolCall] | None:
        calls = []
        for m in self._call.finditer(text, at):
            name = m.group("name") or m.group("name31")
            raw = m.group("args") if m.group("name") else m.group("args31")
            try:
                args = json.loads(raw)
            except json.JSONDecodeError:
                return None
            calls.append(ToolCall(name.strip(), _json_args(args)))
        return calls


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(?P<body>.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, text: str, at: int) -> list[ToolCall] | None:
        calls = []
        for m in self._call.finditer(text, at):
            call = _name_and_args(m.group("body"))
            if call is None:
                return None
            calls.extend(call)
        return calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "{"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>")
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in body.split(";"):
            call = _name_and_args(part)
            if call is None:
                return text, []
            calls.extend(call)
        return None, calls


def _name_and_args(body: str) -> list[ToolCall] | None:
    """{"name", "arguments"|"parameters"} (or a list of them) → calls; None if it is not that."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        calls.append(ToolCall(item["name"], _json_args(args)))
    return calls


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (DeepSeekV3Parser, HermesParser, Llama3JsonParser)
}


def parser_for(chat_template: str | None) -> ToolParser:
    """The syntax a chat template teaches its model; hermes for templates without tools."""
    template = chat_template or ""
    if "tool▁calls▁begin" in template:
        return DeepSeekV3Parser()
    if "<tool_call>" in template:
        return HermesParser()
    if "<|python_tag|>" in template or '"parameters"' in template:
        return Llama3JsonParser()
    return HermesParser()


def parse_required(text: str) -> list[ToolCall]:
    """tool_choice "required": the constrained output [{"name", "arguments"}, ...]."""
    calls = _name_and_args(text)
    return calls or []
