"""JSON grammars bound whitespace (and digits) the way llama.cpp does, honour
vLLM's disable_any_whitespace and whitespace_pattern, and leave the schema's
own strings alone; checked on xgrammar matchers, character by character."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from raylm.core.json_grammar import BOUNDED_JSON_WHITESPACE, json_grammar_ebnf
from raylm.core.structured_output import grammar_spec, validate_structured_outputs
from raylm.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "number"}},
        "mood": {"enum": ["whitespace{0, 977}", "[0-9]*", "root_1"]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _accepts(params: StructuredOutputsParams, text: str) -> bool:
    spec = grammar_spec(params)
    return _is_grammar_accept_string(xgr.Grammar.from_ebnf(json_grammar_ebnf(spec.text, spec.whitespace)), text)


@pytest.mark.parametrize(
    "text, accepted",
    [
        ('{"name": "Ann", "age": 3}', True),
        ('{"name":"Ann","age":3}', True),
        ('{\n  "name": "Ann",\n  "age": 3,\n  "tags": [1.5, -2e3]\n}', True),
        ("{\n" + " " * 20 + '"name": "Ann", "age": 3}', True),  # a newline and an indent of 20
        ("{\n" + " " * 21 + '"name": "Ann", "age": 3}', False),  # one blank too many
        ('{  "name": "Ann", "age": 3}', False),  # two spaces
        ('{\n\n"name": "Ann", "age": 3}', False),  # two newlines
        ('{"name": "Ann", "age": 3}' + " ", False),  # nothing after the object: it ends the output
        ('{"name": "Ann", "age": 1234567890123456}', True),  # 16 digits
        ('{"name": "Ann", "age": 12345678901234567}', False),  # 17
        ('{"name": "Ann", "age": 1, "tags": [0.1234567890123456]}', True),
        ('{"name": "Ann", "age": 1, "tags": [0.12345678901234567]}', False),
        ('{"name": "Ann", "age": 1, "tags": [1e1234567890123456]}', True),
        ('{"name": "Ann", "age": 1, "tags": [1e12345678901234567]}', False),
        # The schema's own strings are kept as written, whatever they look like.
        ('{"name": "Ann", "age": 1, "mood": "whitespace{0, 977}"}', True),
        ('{"name": "Ann", "age": 1, "mood": "[0-9]*"}', True),
        ('{"name": "Ann", "age": 1, "mood": "root_1"}', True),
        ('{"name": "Ann", "age": 1, "mood": "whitespace"}', False),
        ('{"name": "far too long a name", "age": 1}', False),
    ],
)
def test_default_whitespace_is_bounded_as_llama_cpp_bounds_it(text, accepted):
    assert _accepts(StructuredOutputsParams(json=SCHEMA), text) is accepted
    if accepted:
        json.loads(text)


def test_any_json_object_is_bounded_too():
    params = StructuredOutputsParams(json_object=True)
    assert _accepts(params, '{"a": [1, {"b": null}], "c": "x  y"}')  # blanks inside a string are content
    assert not _accepts(params, '{"a":  1}')
    assert not _accepts(params, '["a"]')


@pytest.mark.parametrize(
    "text, accepted",
    [
        ('{"name":"Ann","age":3}', True),
        ('{"name": "Ann","age":3}', False),
        ('{"name":"A n n","age":3}', True),
        ('{"name":"Ann","age":3}\n', False),
    ],
)
def test_disable_any_whitespace_allows_none_at_all(text, accepted):
    assert _accepts(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), text) is accepted


@pytest.mark.parametrize(
    "pattern, text, accepted",
    [
        (r"[ ]?", '{"name": "Ann", "age": 3}', True),
        (r"[ ]?", '{"name":  "Ann", "age": 3}', False),
        (r"[ ]?", '{\n"name": "Ann", "age": 3}', False),
        (r"(\n  )?", '{\n  "name":\n  "Ann",\n  "age":3}', True),
        (r"(\n  )?", '{"name": "Ann","age":3}', False),
        (r"", '{"name":"Ann","age":3}', True),
    ],
)
def test_whitespace_pattern_is_what_may_stand_between_tokens(pattern, text, accepted):
    assert _accepts(StructuredOutputsParams(json=SCHEMA, whitespace_pattern=pattern), text) is accepted


def test_bad_whitespace_options_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="structured_outputs.json is invalid: whitespace_pattern: .*"):
        validate_structured_outputs(StructuredOutputsParams(json=SCHEMA, whitespace_pattern="( "))
    with pytest.raises(ValueError, match="exclude each other"):
        StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ", disable_any_whitespace=True)
    with pytest.raises(ValueError, match="whitespace_pattern applies to json and json_object only"):
        StructuredOutputsParams(regex="a+", whitespace_pattern=" ")


def test_specs_differ_by_whitespace_so_compiled_grammars_are_not_shared():
    kinds = {
        grammar_spec(StructuredOutputsParams(json=SCHEMA)),
        grammar_spec(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
        grammar_spec(StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ")),
    }
    assert len(kinds) == 3
    assert grammar_spec(StructuredOutputsParams(json=SCHEMA)).whitespace == BOUNDED_JSON_WHITESPACE
