"""Fraud screening: a transaction in, a risk verdict a program can act on out.

    make serve   # in another terminal
    python examples/fraud_screening.py

The answer is constrained to the JSON schema below, so `json.loads` and the enum never fail;
whether the verdict is wise depends on the model (the embedded one is small).
"""

from __future__ import annotations

import json

VERDICT = {
    "type": "object",
    "properties": {
        "risk": {"enum": ["low", "medium", "high"]},
        "reasons": {
            "type": "array",
            "items": {"type": "string", "maxLength": 80},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["risk", "reasons"],
}
TRANSACTION = {
    "amount_eur": 9800,
    "merchant": "new overseas account",
    "time": "03:12",
    "card_present": False,
    "customer_usual_amount_eur": 60,
}


def run(client, model: str) -> dict:  # noqa: ANN001
    reply = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You screen card transactions for fraud."},
            {"role": "user", "content": f"Assess this transaction: {json.dumps(TRANSACTION)}"},
        ],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True},
        },
        temperature=0,
        max_tokens=200,
    )
    return json.loads(reply.choices[0].message.content)


if __name__ == "__main__":
    from _client import client_and_model

    print(json.dumps(run(*client_and_model()), indent=2))
