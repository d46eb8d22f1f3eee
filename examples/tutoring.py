"""A tutoring turn with a structured hint: the app shows the hint, colours it by difficulty,
and only reveals the next step when the student asks.

    make serve   # in another terminal
    python examples/tutoring.py
"""

from __future__ import annotations

import json

HINT = {
    "type": "object",
    "properties": {
        "hint": {"type": "string", "maxLength": 120},
        "concept": {"enum": ["fractions", "equations", "geometry", "percentages"]},
        "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
        "next_step": {"type": "string", "maxLength": 120},
    },
    "required": ["hint", "concept", "difficulty", "next_step"],
}


def run(client, model: str) -> dict:  # noqa: ANN001
    reply = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are a patient maths tutor. Never give the answer."},
            {"role": "user", "content": "I don't get how to solve 3x + 5 = 20."},
        ],
        response_format={"type": "json_schema", "json_schema": {"name": "hint", "schema": HINT}},
        temperature=0.7,
        seed=1,
        max_tokens=160,
    )
    return json.loads(reply.choices[0].message.content)


if __name__ == "__main__":
    from _client import client_and_model

    print(json.dumps(run(*client_and_model()), indent=2))
