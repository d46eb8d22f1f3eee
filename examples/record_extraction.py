"""Record extraction: a free-text clinical note in, typed fields out.

make serve   # in another terminal
python examples/record_extraction.py
"""

from __future__ import annotations

import json

RECORD = {
    "type": "object",
    "properties": {
        "patient_age": {"type": "integer", "minimum": 0, "maximum": 120},
        "sex": {"enum": ["female", "male", "unknown"]},
        "diagnosis": {"type": "string", "maxLength": 60},
        "medications": {
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "maxItems": 5,
        },
        "follow_up_days": {"type": ["integer", "null"], "minimum": 0, "maximum": 365},
    },
    "required": ["patient_age", "sex", "diagnosis", "medications", "follow_up_days"],
}
NOTE = (
    "58 y/o woman seen for persistent cough and fever for 5 days. Chest X-ray shows right "
    "lower lobe pneumonia. Started amoxicillin 1 g three times daily; continue metformin for "
    "her type 2 diabetes. Review in clinic in 14 days."
)


def run(client, model: str) -> dict:  # noqa: ANN001
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Extract the record from this note:\n{NOTE}"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": RECORD},
        },
        temperature=0,
        max_tokens=200,
    )
    return json.loads(reply.choices[0].message.content)


if __name__ == "__main__":
    from _client import client_and_model

    print(json.dumps(run(*client_and_model()), indent=2, ensure_ascii=False))
