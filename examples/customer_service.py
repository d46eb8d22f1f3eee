"""Customer service in English and Chinese with a tool: the model asks for `lookup_order`, we
run it, send the result back, and the model answers the customer.

    make serve   # in another terminal
    python examples/customer_service.py

tool_choice "required" makes the first turn a valid call of a listed tool (constrained
decoding); the second turn answers the customer (tool_choice "none", a one-field JSON reply so
the app always gets a message to show).
"""

from __future__ import annotations

import json

ORDERS = {"AB1234": {"status": "shipped", "eta": "2026-12-08"}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Look up an order's status by its id (two letters, four digits)",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}},
                "required": ["order_id"],
            },
        },
    }
]
REPLY = {
    "type": "object",
    "properties": {"reply": {"type": "string", "minLength": 1, "maxLength": 200}},
    "required": ["reply"],
}
QUESTIONS = {
    "en": "Hello, where is my order AB1234?",
    "zh": "你好，我的订单 AB1234 到哪里了？",
}


def lookup_order(order_id: str) -> dict:
    return ORDERS.get(order_id, {"status": "not found"})


def run(client, model: str, language: str = "en") -> dict:  # noqa: ANN001
    messages = [
        {"role": "system", "content": "You are a helpful support agent. Answer in the customer's language."},
        {"role": "user", "content": QUESTIONS[language]},
    ]  # fmt: skip
    first = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    result = lookup_order(**json.loads(call.function.arguments))
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none",
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": REPLY}},
        temperature=0, max_tokens=80,
    )  # fmt: skip
    return {
        "call": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
        "result": result,
        "answer": json.loads(answer.choices[0].message.content)["reply"],
        "finish_reason": first.choices[0].finish_reason,
    }


if __name__ == "__main__":
    from _client import client_and_model

    client, model = client_and_model()
    for lang in QUESTIONS:
        print(json.dumps(run(client, model, lang), indent=2, ensure_ascii=False))
