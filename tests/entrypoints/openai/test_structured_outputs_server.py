"""Structured outputs over HTTP, through the official openai client:
response_format (json_schema, json_object), vLLM's structured_outputs object
and its guided_* fields; every sampled output follows its grammar (checked
with jsonschema / re), and a grammar xgrammar cannot parse is a 400 naming the
field, with xgrammar's message.

The server runs the engine tests' "closer-loving" tiny model (a random model
that favours '"', '}' and ']'), so that JSON without a length bound (any
object, strings) still ends well within max_tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.engine.test_structured_outputs import CHOICES, EBNF, EBNF_AS_REGEX, REGEX, SCHEMA, _closer_loving_model
from tests.entrypoints.openai.server_utils import API_KEY, MODEL_NAME, RaylmServer
from tests.entrypoints.openai.test_json_whitespace_server import blanks_outside_strings

NUM_SAMPLES = 6
MAX_TOKENS = 96
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    folder = _closer_loving_model(
        tiny_model_dir("llama", tie_word_embeddings=False), tmp_path_factory.mktemp("closers") / "model"
    )
    srv = RaylmServer(folder, ["--api-key", API_KEY], str(tmp_path_factory.mktemp("serve") / "server.log"))
    try:
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def _chat_texts(client, temperature: float = 1.0, **kwargs) -> list[str]:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        n=NUM_SAMPLES,
        temperature=temperature,
        max_tokens=MAX_TOKENS,
        seed=7,
        **kwargs,
    )
    assert len(response.choices) == NUM_SAMPLES
    # "stop": the grammar ended the output, not max_tokens.
    assert all(c.finish_reason == "stop" for c in response.choices), [c.message.content for c in response.choices]
    return [c.message.content for c in response.choices]


def test_json_schema_response_format_validates(client):
    texts = _chat_texts(client, response_format=_json_schema_format(SCHEMA))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampled, not one forced answer


def test_json_schema_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=1.0,
        seed=11,
        max_tokens=MAX_TOKENS,
        stream=True,
        response_format=_json_schema_format(SCHEMA),
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_response_format_parses(client):
    # Any JSON object, any whitespace (as in vLLM): a cooler temperature
    # sharpens the model's taste for closers, so that objects end in time.
    for text in _chat_texts(client, temperature=0.5, response_format={"type": "json_object"}):
        assert isinstance(json.loads(text), dict)


def test_text_response_format_is_unconstrained(client):
    # {"type": "text"} constrains nothing: the same seed gives the same text as no response_format.
    def text(**kwargs):
        return (
            client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=5, max_tokens=8, **kwargs
            )
            .choices[0]
            .message.content
        )

    assert text(response_format={"type": "text"}) == text()


def test_completions_json_schema(client):
    response = client.completions.create(
        model=MODEL_NAME,
        prompt="A person:",
        n=NUM_SAMPLES,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        seed=3,
        extra_body={"response_format": _json_schema_format(SCHEMA)},
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def _regex_check(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


@pytest.mark.parametrize(
    "extra_body, follows",
    [
        ({"structured_outputs": {"regex": REGEX}}, _regex_check(REGEX)),
        ({"guided_regex": REGEX}, _regex_check(REGEX)),
        ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
        ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
        ({"structured_outputs": {"grammar": EBNF}}, _regex_check(EBNF_AS_REGEX)),
        ({"guided_grammar": EBNF}, _regex_check(EBNF_AS_REGEX)),
        ({"guided_json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None and "\n" not in text,
        ),
    ],
    ids=[
        "so-regex",
        "guided_regex",
        "so-choice",
        "guided_choice",
        "so-grammar",
        "guided_grammar",
        "guided_json",
        "so-json-compact",
    ],
)
def test_vllm_fields_via_extra_body(client, extra_body, follows):
    for text in _chat_texts(client, extra_body=extra_body):
        assert follows(text), text


def test_vllm_json_object_without_whitespace(client):
    # Any JSON object, as test_json_object_response_format_parses: a cooler
    # temperature, so that objects end in time; no blank between tokens.
    extra_body = {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}
    for text in _chat_texts(client, temperature=0.5, extra_body=extra_body):
        assert isinstance(json.loads(text), dict)
        assert blanks_outside_strings(text) == [], text


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        (
            {"response_format": _json_schema_format({"type": "object", "properties": {"a": {"type": "nonsense"}}})},
            "response_format",
            'Unsupported type "nonsense"',
        ),
        (
            {"response_format": _json_schema_format({"type": "integer", "minimum": 5, "maximum": 1})},
            "response_format",
            "minimum greater than maximum",
        ),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex", "Unclosed '['"),
        (
            {"extra_body": {"structured_outputs": {"grammar": "root ::= foo"}}},
            "structured_outputs",
            'Rule "foo" is not defined',
        ),
        ({"extra_body": {"guided_json": "{not json"}}, "guided_json", "Failed to parse JSON"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty list"),
        (
            {"extra_body": {"structured_outputs": {"disable_any_whitespace": True}}},
            "structured_outputs",
            "exactly one of",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}},
            "structured_outputs",
            "whitespace_pattern",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
            "guided_regex",
            "only one way",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
    ],
)
def test_invalid_grammar_is_400_naming_the_field(client, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, **kwargs)
    assert error.value.status_code == 400
    assert error.value.param == param
    assert message in error.value.message


def test_invalid_grammar_on_completions(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(
            model=MODEL_NAME,
            prompt="x",
            max_tokens=4,
            extra_body={"response_format": _json_schema_format({"type": "nonsense"})},
        )
    assert error.value.param == "response_format" and "nonsense" in error.value.message


@pytest.mark.parametrize(
    "extra_body, param, message",
    [
        ({"use_beam_search": True}, "use_beam_search", "not supported"),
        ({"logits_processors": ["my.module.Processor"]}, "logits_processors", "not supported"),
        ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
    ],
)
def test_unsupported_field_is_400(client, extra_body, param, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_body=extra_body)
    assert error.value.param == param and message in error.value.message


def test_server_serves_after_refusals(client):
    text = _chat_texts(client, response_format=_json_schema_format(SCHEMA))[0]
    jsonschema.validate(json.loads(text), SCHEMA)
