"""The server's JSON whitespace default (--structured-outputs-config, vLLM's
flag) and how a request's own choice overrides it, in process: the
StructuredOutputsParams each request turns into."""

from __future__ import annotations

import pytest

from raylm.entrypoints.cli import build_parser
from raylm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from raylm.entrypoints.openai.serving_common import OpenAIError
from raylm.entrypoints.openai.structured_outputs import StructuredOutputDefaults, structured_outputs_params

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
USER = [{"role": "user", "content": "x"}]


def _params(defaults: StructuredOutputDefaults | None, **fields):
    request = ChatCompletionRequest(messages=USER, **fields)
    request._structured_outputs_defaults = defaults
    return structured_outputs_params(request)[0]


NONE = StructuredOutputDefaults.from_json('{"disable_any_whitespace": true}')
PATTERN = StructuredOutputDefaults.from_json('{"whitespace_pattern": "[ ]?", "backend": "xgrammar"}')


@pytest.mark.parametrize(
    "defaults, fields, disable, pattern",
    [
        (None, {"response_format": {"type": "json_object"}}, False, None),
        (NONE, {"response_format": {"type": "json_object"}}, True, None),
        (NONE, {"guided_json": SCHEMA}, True, None),
        (
            PATTERN,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            False,
            "[ ]?",
        ),
        # The request's own choice wins.
        (NONE, {"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": False}}, False, None),
        (NONE, {"guided_json": SCHEMA, "guided_whitespace_pattern": "\\n?"}, False, "\\n?"),
        (None, {"structured_outputs": {"json_object": True, "whitespace_pattern": " "}}, False, " "),
        # Not JSON: no whitespace default applies.
        (PATTERN, {"guided_regex": "a+"}, False, None),
    ],
)
def test_server_default_and_request_choice(defaults, fields, disable, pattern):
    params = _params(defaults, **fields)
    assert (params.disable_any_whitespace, params.whitespace_pattern) == (disable, pattern)


def test_completions_take_the_default_too():
    request = CompletionRequest(prompt="x", guided_json=SCHEMA)
    request._structured_outputs_defaults = NONE
    assert structured_outputs_params(request)[0].disable_any_whitespace is True


def test_whitespace_options_alone_are_a_400():
    with pytest.raises(OpenAIError) as error:
        _params(None, structured_outputs={"disable_any_whitespace": True})
    assert (error.value.status_code, error.value.param) == (400, "structured_outputs")


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1]", "must be a JSON object"),
        ("{nope", "must be a JSON object"),
        ('{"backend": "outlines"}', "not available"),
        ('{"disable_any_whitespace": "yes"}', "must be a bool"),
        ('{"disable_any_whitespace": true, "whitespace_pattern": " "}', "exclude each other"),
        ('{"whitespace_pattern": "("}', "whitespace_pattern"),
        ('{"reasoning_parser": "qwen3"}', "unknown keys"),
    ],
)
def test_bad_server_config_is_refused_at_start(text, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputDefaults.from_json(text)


def test_serve_flags():
    args = build_parser().parse_args(
        [
            "serve",
            "--structured-outputs-config",
            '{"disable_any_whitespace": true}',
            "--reasoning-parser",
            "qwen3",
            "--tool-call-parser",
            "qwen3_coder",
        ]
    )
    assert StructuredOutputDefaults.from_json(args.structured_outputs_config).disable_any_whitespace
    assert (args.reasoning_parser, args.tool_call_parser) == ("qwen3", "qwen3_coder")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "nope"])
