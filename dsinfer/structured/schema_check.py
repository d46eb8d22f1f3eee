"""Which JSON-schema features constrained decoding enforces, and a check that names the rest.

xgrammar compiles the keywords below into the grammar. Others it would skip silently (measured
with xgrammar 0.2.8: `allOf`, `not`, `if`/`then`/`else`, `uniqueItems`, `dependentRequired`,
`dependentSchemas` and unknown `format`s each let a violating output through), so a schema that
uses one is refused with the keyword and where it sits: an output we cannot guarantee is not
promised.
"""

from __future__ import annotations

from typing import Any

# Keywords that constrain the output and that the grammar enforces.
ENFORCED = frozenset(
    {
        "type", "enum", "const", "properties", "required", "additionalProperties",
        "patternProperties", "propertyNames", "unevaluatedProperties", "minProperties",
        "items", "prefixItems", "minItems", "maxItems", "anyOf", "oneOf", "$ref",
        "pattern", "minLength", "maxLength", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    }
)  # fmt: skip
# Keywords that describe and do not constrain: accepted and ignored.
ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$id", "$comment",
        "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "strict", "nullable",
    }
)  # fmt: skip
FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "uri", "uri-reference", "uuid",
        "ipv4", "ipv6", "hostname",
    }
)  # fmt: skip
# keyword → how its value holds subschemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties")


def check_json_schema(schema: Any, path: str = "#") -> None:
    """ValueError naming the first keyword (and its JSON pointer) the grammar cannot enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"the schema at {path} must be an object or a boolean")
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise ValueError(
                f"JSON-schema keyword '{key}' (at {where}) is not supported by constrained "
                "decoding here; remove it or express it with supported keywords "
                "(docs/structured_outputs.md lists them)"
            )
        if key == "format" and value not in FORMATS:
            raise ValueError(
                f"JSON-schema format {value!r} (at {where}) is not supported; supported: "
                f"{', '.join(sorted(FORMATS))}"
            )
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise ValueError(f"$ref {value!r} (at {where}): only local references (#/...) work")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_json_schema(sub, f"{where}/{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_json_schema(sub, f"{where}/{i}")
        elif key in _SCHEMA_ONE:
            check_json_schema(value, where)
