"""Schema-driven fuzzing (schemathesis) of every route /openapi.json lists, against a real server.

schemathesis reads the server's own API description and sends requests that follow it
(positive) and requests that break it (negative) to every operation; each answer is checked
against the description: no 5xx, only the status codes and content types the route documents,
bodies in the documented shapes, 4xx for a request that breaks the schema, 401 without the key.
Not checked: that every schema-valid request is accepted (`positive_data_acceptance`), since some
refusals depend on the model, not the schema (a token id beyond its vocabulary, a prompt longer
than its context, an unknown model name). Afterwards the server still serves and no KV block is
held. The hypothesis fuzzer beside it (test_fuzz.py) sends what no schema describes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import given
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.serving import ServedModel
from tests.server.conftest import assert_still_serving, fuzz_settings, running_server

KEY, ADMIN_KEY = "schema-key", "schema-admin-key"
EXAMPLES = int(os.environ.get("DSINFER_SCHEMA_EXAMPLES", "25"))  # per operation and mode


@pytest.fixture(scope="module")
def schema_server(tiny_smol) -> Iterator[tuple[str, ServedModel]]:
    app = build_app(
        {"tiny": tiny_smol},
        ServerSettings(api_key=KEY, admin_api_key=ADMIN_KEY, max_queued_requests=64),
    )
    with running_server(app) as url:
        yield url, tiny_smol


def _auth(path: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY if path.startswith('/admin/') else KEY}"}


def _failures(url: str, mode: GenerationMode, examples: int) -> list[str]:
    """Every operation of the served description fuzzed in `mode`; what failed, by operation."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=_auth("/"))
    failed = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14, [op.label for op in operations]  # every route is described
    for op in operations:

        @fuzz_settings(examples)
        @given(case=op.as_strategy(generation_mode=mode))
        def one(case) -> None:  # noqa: ANN001
            case.call_and_validate(
                base_url=url,
                headers=_auth(case.operation.path),
                timeout=60,
                excluded_checks=[schemathesis.checks.positive_data_acceptance],
            )

        try:
            one()
        except Unsatisfiable:  # nothing to break: a route without parameters or body
            if mode is not GenerationMode.NEGATIVE:
                raise
        except Exception as e:  # noqa: BLE001  (each operation's findings, then one assert)
            failed.append(f"{op.label} ({mode.value}): {e}")
    return failed


def _fuzz(schema_server, mode: GenerationMode, examples: int) -> None:  # noqa: ANN001
    url, served = schema_server
    failed = _failures(url, mode, examples)
    assert not failed, "\n\n".join(failed)
    assert_still_serving(url, served, KEY)


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_every_route_answers_as_its_description_says(schema_server, mode) -> None:  # noqa: ANN001
    _fuzz(schema_server, mode, EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_every_route_answers_as_its_description_says_long(schema_server, mode) -> None:  # noqa: ANN001
    _fuzz(schema_server, mode, int(os.environ.get("DSINFER_SCHEMA_EXAMPLES_LONG", "500")))
