"""Structured outputs that finish, on the embedded default model (a small
Shakespeare model that has seen a few JSON replies) through `raylm serve` and the
openai client, at temperature 1.0: JSON grammars bound the whitespace between
tokens (one space, or a newline and an indent of at most 20) and the digits of
numbers, so a schema-held object finishes with "stop" and validates;
disable_any_whitespace and whitespace_pattern are honoured per request; an
object cut by max_tokens says "length". One server for the module."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.entrypoints.openai.server_utils import API_KEY, MODEL_NAME, RaylmServer

pytestmark = pytest.mark.server

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 300
PER_REQUEST = 5
BOUNDED_RUN = re.compile(r"( |\n[ \t]{0,20})?")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    server = RaylmServer(None, ["--api-key", API_KEY], str(tmp_path_factory.mktemp("serve") / "server.log"))
    try:
        with openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=300) as c:
            yield c
    finally:
        server.terminate()


def blanks_outside_strings(text: str) -> list[str]:
    """The runs of whitespace between JSON tokens (a string's content is not one)."""
    runs, run, in_string, escaped = [], "", False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char in " \t\r\n":
            run += char
            continue
        if run:
            runs.append(run)
            run = ""
        in_string = char == '"'
    return runs + ([run] if run else [])


def _choices(client, response_format=None, seed=0, messages=MESSAGES, **extra_body):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        n=PER_REQUEST,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        seed=seed,
        response_format=response_format,
        extra_body=extra_body or None,
    )
    return response.choices


def _schema_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def test_json_schema_outputs_finish_and_validate(client):
    choices = [c for seed in range(4) for c in _choices(client, _schema_format(), seed=seed)]
    assert len(choices) == 20
    for choice in choices:
        text = choice.message.content
        assert choice.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        assert all(BOUNDED_RUN.fullmatch(run) for run in blanks_outside_strings(text)), text


def test_json_object_outputs_finish_and_parse(client):
    """Any object (no schema: a string has no length bound), at temperature 1.0:
    every one ends with "stop" as a JSON object, its blanks bounded. The model
    closes its strings and objects because its training saw JSON replies; the
    second request's wording is not one of its training requests."""
    unseen = [{"role": "user", "content": "What cargo does the ship carry? Reply in JSON."}]
    choices = [
        c
        for seed, messages in enumerate([MESSAGES, unseen])
        for c in _choices(client, {"type": "json_object"}, seed=seed, messages=messages)
    ]
    assert len(choices) == 10
    for choice in choices:
        text = choice.message.content
        assert choice.finish_reason == "stop", text
        assert isinstance(json.loads(text), dict), text
        assert all(BOUNDED_RUN.fullmatch(run) for run in blanks_outside_strings(text)), text


@pytest.mark.parametrize("response_format", [_schema_format(), {"type": "json_object"}], ids=["schema", "object"])
def test_disable_any_whitespace_leaves_no_blank_outside_strings(client, response_format):
    choices = _choices(client, response_format, seed=11, structured_outputs={"disable_any_whitespace": True})
    for choice in choices:
        assert blanks_outside_strings(choice.message.content) == [], choice.message.content
        if response_format["type"] == "json_schema":
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_whitespace_pattern_per_request(client):
    choices = _choices(client, seed=12, structured_outputs={"json": SCHEMA, "whitespace_pattern": "[ ]?"})
    for choice in choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert set(blanks_outside_strings(choice.message.content)) <= {" "}, choice.message.content


def test_an_object_cut_by_max_tokens_says_length(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=1.0, max_tokens=3, seed=1, response_format=_schema_format()
    )
    assert response.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(response.choices[0].message.content)


def test_a_bad_whitespace_pattern_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=4,
            extra_body={"guided_json": SCHEMA, "guided_whitespace_pattern": "( "},
        )
    assert error.value.status_code == 400 and error.value.param == "guided_json"
    assert "whitespace_pattern" in error.value.message
