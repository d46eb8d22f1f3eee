"""Which request fields the server honours, and what it says about the rest.

Nothing is silently ignored: a field the request models declare is implemented; a field of the
OpenAI schema or a common vLLM extra that is not implemented yet is answered with 400 naming it
(unless it carries its "off" value, e.g. `tool_choice: "none"`); a short documented list is
accepted as a no-op; anything else is an unknown field → 400, or dropped with a log line when
the server runs with `--lenient-fields`. docs/server.md has the table.
"""

from __future__ import annotations

import logging
from typing import Any

from dsinfer.server.errors import APIError

logger = logging.getLogger(__name__)

# Accepted and dropped: they describe the request for OpenAI's own storage and billing.
NO_OPS = frozenset({"store", "metadata", "service_tier"})

_TOOLS = "tool calling is available on /v1/chat/completions (tools, tool_choice)"

# field → why it is refused on both endpoints; then what only one endpoint refuses.
NOT_IMPLEMENTED: dict[str, str] = {
    "functions": "the deprecated functions field is not supported; send tools",
    "function_call": "the deprecated function_call field is not supported; send tool_choice",
    "audio": "audio output is not supported: these models write text",
    "modalities": "only text output is supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning effort cannot be set: DeepSeek-R1-style models have no "
    "effort control (the reasoning is parsed apart into reasoning_content)",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
}
COMPLETIONS_ONLY_REFUSED: dict[str, str] = {
    "tools": _TOOLS,
    "tool_choice": _TOOLS,
    "parallel_tool_calls": _TOOLS,
}
CHAT_ONLY_REFUSED: dict[str, str] = {
    "echo": "echo is not available on chat; use /v1/completions with echo",
    "prompt_logprobs": "prompt logprobs are not available on chat; use /v1/completions with "
    "echo and logprobs",
}

# The "off" value of a refused field, which is accepted (it asks for nothing).
_OFF: dict[str, Any] = {
    "tool_choice": "none",
    "tools": [],
    "functions": [],
    "modalities": ["text"],
    "use_beam_search": False,
}


def screen_fields(data: dict[str, Any], known: set[str], chat: bool, lenient: bool) -> dict:
    """The body without no-op fields; 400 for a refused or unknown field (see module doc)."""
    out = {}
    for key, value in data.items():
        if key in known:
            out[key] = value
            continue
        endpoint_refused = CHAT_ONLY_REFUSED if chat else COMPLETIONS_ONLY_REFUSED
        why = NOT_IMPLEMENTED.get(key) or endpoint_refused.get(key)
        if why is not None:
            if value is None or _OFF.get(key, object()) == value:
                continue
            raise APIError(
                400, f"'{key}' is not supported: {why}", param=key, code="unsupported_field"
            )
        if key in NO_OPS:
            continue
        if lenient:
            logger.info("ignoring unknown request field %r (--lenient-fields)", key)
            continue
        raise APIError(
            400,
            f"unknown field '{key}'; check its spelling, or start the server with "
            "--lenient-fields to ignore unknown fields",
            param=key,
            code="unknown_field",
        )
    return out
