"""A request's structured-output fields -> StructuredOutputsParams.

Clients ask for structured outputs three ways: OpenAI's `response_format`,
vLLM's `structured_outputs` object, and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`; a request may use one. The
grammar is checked here, before the request is submitted, so a schema or regex
xgrammar cannot parse is a 400 naming the field the client sent, with
xgrammar's message (the engine would only fail the request after admitting it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from raylm.core.structured_output import grammar_problem
from raylm.entrypoints.openai.protocol import SamplingFields
from raylm.entrypoints.openai.serving_common import OpenAIError
from raylm.sampling_params import StructuredOutputsParams

_GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                  ("guided_grammar", "grammar"))


def _from_response_format(request: SamplingFields) -> dict[str, Any] | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type == "json_schema":
        if response_format.json_schema is None or response_format.json_schema.json_schema is None:
            raise OpenAIError("response_format of type 'json_schema' needs json_schema.schema", 400,
                              "response_format")
        return {"json": response_format.json_schema.json_schema}
    raise OpenAIError(f"response_format type {response_format.type!r} is not supported "
                      "(supported: 'text', 'json_object', 'json_schema')", 400, "response_format")


def _requested(request: SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    """(field sent, StructuredOutputsParams arguments) for each way used."""
    requested = []
    from_format = _from_response_format(request)
    if from_format is not None:
        requested.append(("response_format", from_format))
    so = request.structured_outputs
    if so is not None:
        requested.append(("structured_outputs", {
            "json": so.json_schema, "json_object": so.json_object, "regex": so.regex, "choice": so.choice,
            "grammar": so.grammar, "disable_any_whitespace": so.disable_any_whitespace,
        }))
    for field, key in _GUIDED_FIELDS:
        value = getattr(request, field)
        if value is not None:
            requested.append((field, {key: value}))
    return requested


def structured_outputs_params(request: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's grammar (its shape checked, not yet compiled) and the
    field it came from; (None, None) for an unconstrained request."""
    requested = _requested(request)
    if not requested:
        return None, None
    if len(requested) > 1:
        fields = ", ".join(field for field, _ in requested)
        raise OpenAIError(f"only one way to constrain the output may be used per request, got {fields}", 400,
                          requested[1][0])
    field, kwargs = requested[0]
    try:
        return StructuredOutputsParams(**kwargs), field
    except ValueError as e:
        raise OpenAIError(str(e), 400, field) from e


async def checked_structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """structured_outputs_params, with the grammar parsed (off the event
    loop: a large schema takes a while): 400 with xgrammar's message if it
    does not parse."""
    params, field = structured_outputs_params(request)
    if params is None:
        return None
    problem = await asyncio.get_running_loop().run_in_executor(None, grammar_problem, params)
    if problem is not None:
        raise OpenAIError(f"{field} is invalid: {problem}", 400, field)
    return params
