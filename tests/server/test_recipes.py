"""The five recipes in examples/ against a real server with the real SmolLM2 weights, through
the official `openai` client: each answer has the structure its program needs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jsonschema
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _recipe(name: str):  # noqa: ANN202
    sys.path.insert(0, str(EXAMPLES))  # the recipes import their shared _client helper
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "schema"),
    [
        ("fraud_screening", "VERDICT"),
        # One JSON recipe in make test; the others (~5 s each) in make test-slow.
        pytest.param("record_extraction", "RECORD", marks=pytest.mark.slow),
        pytest.param("summarisation", "SUMMARY", marks=pytest.mark.slow),
        pytest.param("tutoring", "HINT", marks=pytest.mark.slow),
    ],
)
def test_json_recipes_validate(client, name, schema):
    recipe = _recipe(name)
    out = recipe.run(client, "smollm2")
    jsonschema.validate(out, getattr(recipe, schema))


# Tool calling end to end is in make test through test_tool_calls.py; the recipe's two
# languages run in make test-slow.
@pytest.mark.slow
@pytest.mark.parametrize("language", ["en", "zh"])
def test_customer_service_calls_the_tool_then_answers(client, language):
    recipe = _recipe("customer_service")
    out = recipe.run(client, "smollm2", language)
    assert out["call"]["name"] == "lookup_order"
    jsonschema.validate(out["call"]["arguments"], recipe.TOOLS[0]["function"]["parameters"])
    assert out["finish_reason"] == "tool_calls"
    assert isinstance(out["answer"], str) and out["answer"].strip()
