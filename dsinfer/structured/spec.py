"""StructuredOutputs: what a request's output must match, as plain data.

It rides in SamplingParams (pickled to tensor-parallel ranks with it), so it holds text only;
the grammar it compiles to lives with the compiler (structured/grammar.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class UnsatisfiableConstraint(ValueError):
    """A request's constraint allows no token where its output stands: no text satisfies it
    from there. The request's fault (HTTP 400), raised while it is decoded."""


def only_one(values: dict[str, Any], subject: str) -> tuple[str, Any]:
    """The one constraint set among `values` (kind → value, None: unset), or ValueError naming
    what was given. `subject` starts the message ("structured_outputs takes")."""
    given = [(k, values[k]) for k in KINDS if values.get(k) is not None]
    if len(given) != 1:
        raise ValueError(
            f"{subject} exactly one of {', '.join(KINDS)}; "
            f"got {', '.join(k for k, _ in given) or 'none'}"
        )
    return given[0]


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """Exactly one constraint: a JSON schema, any JSON object, a regex, a choice of strings,
    or an EBNF grammar. Hashable: it is the grammar cache's key."""

    json: str | None = None  # a JSON schema, serialised
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF, as xgrammar reads it (GBNF style: root ::= ...)

    def __post_init__(self) -> None:
        values = {k: getattr(self, k) for k in KINDS}
        only_one({**values, "json_object": self.json_object or None}, "structured outputs take")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("a choice needs at least one non-empty string")

    @classmethod
    def from_schema(cls, schema: dict[str, Any] | str) -> StructuredOutputs:
        """A JSON schema given as a dict or as JSON text (ValueError when it is not JSON)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema is an object")
        # Key order kept: the grammar writes properties in the order the schema lists them.
        return cls(json=json.dumps(schema, ensure_ascii=False))

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema this constraint enforces (None for regex, choice and grammar)."""
        if self.json is not None:
            return json.loads(self.json)
        return {"type": "object"} if self.json_object else None
