"""Shared by the recipes: an `openai` client for the server `make serve` starts."""

from __future__ import annotations

import os


def client_and_model():  # noqa: ANN201
    """(OpenAI client, model name) from DSINFER_URL (default http://127.0.0.1:8000/v1),
    DSINFER_API_KEY and DSINFER_MODEL (default: the server's first model)."""
    import openai

    client = openai.OpenAI(
        base_url=os.environ.get("DSINFER_URL", "http://127.0.0.1:8000/v1"),
        api_key=os.environ.get("DSINFER_API_KEY", "none"),
    )
    model = os.environ.get("DSINFER_MODEL") or client.models.list().data[0].id
    return client, model
