"""Integers the engine cannot carry (past 64 bits) in a request are a 400
naming the field, never an engine failure (issue 21)."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.server_utils import MODEL_NAME

HUGE = 2**70


@pytest.mark.parametrize(
    "field, extra",
    [
        (
            "response_format",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "object", "properties": {"a": {"enum": [HUGE]}}}},
                }
            },
        ),
        ("structured_outputs", {"structured_outputs": {"json": {"enum": [-HUGE]}}}),
        ("seed", {"seed": HUGE}),
    ],
)
def test_an_int_past_64_bits_is_a_400_naming_its_field(http, field, extra):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert field in response.text
    assert http.post("/v1/chat/completions", json={**body, **{k: None for k in extra}}).status_code == 200
