"""Structured outputs: constraints (spec), the schema features we enforce, grammar compiling."""

from dsinfer.structured.grammar import GrammarCompiler, compiler_for
from dsinfer.structured.schema_check import check_json_schema
from dsinfer.structured.spec import StructuredOutputs

__all__ = ["GrammarCompiler", "StructuredOutputs", "check_json_schema", "compiler_for"]
