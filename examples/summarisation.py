"""Summarisation with a length limit: the summary field is capped by the schema, so no answer
is ever longer than the screen it is shown on.

    make serve   # in another terminal
    python examples/summarisation.py
"""

from __future__ import annotations

import json

MAX_CHARS = 160
SUMMARY = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "minLength": 10, "maxLength": MAX_CHARS},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["summary", "topics"],
}
ARTICLE = (
    "The city council voted on Tuesday to extend the tram line to the northern suburbs. The "
    "extension adds six stops and is expected to open in 2029. Supporters say it will cut car "
    "traffic; critics point to the cost, estimated at 240 million euros, and to two years of "
    "road works on the main avenue."
)


def run(client, model: str) -> dict:  # noqa: ANN001
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Summarise in one sentence:\n{ARTICLE}"}],
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SUMMARY}},
        temperature=0,
        max_tokens=150,
    )
    return json.loads(reply.choices[0].message.content)


if __name__ == "__main__":
    from _client import client_and_model

    print(json.dumps(run(*client_and_model()), indent=2))
