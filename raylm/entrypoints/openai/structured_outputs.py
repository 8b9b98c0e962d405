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
import json
from dataclasses import dataclass
from typing import Any

from raylm.core.structured_output import grammar_problem
from raylm.entrypoints.openai.protocol import SamplingFields
from raylm.entrypoints.openai.serving_common import OpenAIError
from raylm.sampling_params import StructuredOutputsParams

_GUIDED_FIELDS = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


@dataclass(frozen=True)
class StructuredOutputDefaults:
    """The server's JSON whitespace for requests that do not choose their own
    (--structured-outputs-config, vLLM's flag): none at all, a pattern, or
    (neither) raylm's bounded default."""

    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise ValueError(
                "--structured-outputs-config: disable_any_whitespace and whitespace_pattern exclude "
                "each other; give one"
            )
        if self.whitespace_pattern is not None:
            # A pattern xgrammar cannot read fails the server's start, not each request.
            problem = grammar_problem(
                StructuredOutputsParams(json_object=True, whitespace_pattern=self.whitespace_pattern)
            )
            if problem is not None:
                raise ValueError(f"--structured-outputs-config: {problem}")

    @classmethod
    def from_json(cls, text: str | None) -> StructuredOutputDefaults:
        """vLLM's --structured-outputs-config JSON; of its keys, backend may only
        name xgrammar (raylm's one backend)."""
        if not text:
            return cls()
        try:
            config = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--structured-outputs-config must be a JSON object: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"--structured-outputs-config must be a JSON object, got {text!r}")
        config = dict(config)
        backend = config.pop("backend", "xgrammar")
        if backend not in ("auto", "xgrammar"):
            raise ValueError(f"--structured-outputs-config: backend {backend!r} is not available (xgrammar only)")
        unknown = sorted(set(config) - {"disable_any_whitespace", "whitespace_pattern"})
        if unknown:
            raise ValueError(
                f"--structured-outputs-config: unknown keys {unknown} "
                "(known: backend, disable_any_whitespace, whitespace_pattern)"
            )
        disable = config.get("disable_any_whitespace", False)
        pattern = config.get("whitespace_pattern")
        if not isinstance(disable, bool) or not (pattern is None or isinstance(pattern, str)):
            raise ValueError(
                "--structured-outputs-config: disable_any_whitespace must be a bool and whitespace_pattern a string"
            )
        return cls(disable, pattern)


def _from_response_format(request: SamplingFields) -> dict[str, Any] | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type == "json_schema":
        if response_format.json_schema is None or response_format.json_schema.json_schema is None:
            raise OpenAIError("response_format of type 'json_schema' needs json_schema.schema", 400, "response_format")
        return {"json": response_format.json_schema.json_schema}
    raise OpenAIError(
        f"response_format type {response_format.type!r} is not supported "
        "(supported: 'text', 'json_object', 'json_schema')",
        400,
        "response_format",
    )


def _requested(request: SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    """(field sent, StructuredOutputsParams arguments) for each way used."""
    requested = []
    from_format = _from_response_format(request)
    if from_format is not None:
        requested.append(("response_format", from_format))
    so = request.structured_outputs
    if so is not None:
        grammar = {
            "json": so.json_schema,
            "json_object": so.json_object,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
        }
        # An object with whitespace options alone shapes the JSON another field asks for.
        if any(value not in (None, False) for value in grammar.values()):
            requested.append(("structured_outputs", grammar))
    for field, key in _GUIDED_FIELDS:
        value = getattr(request, field)
        if value is not None:
            requested.append((field, {key: value}))
    if so is not None and not requested:
        raise OpenAIError(
            "structured_outputs: exactly one of json, json_object, regex, choice, grammar must be set, got none",
            400,
            "structured_outputs",
        )
    return requested


def structured_outputs_params(request: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's grammar (its shape checked, not yet compiled) and the
    field it came from; (None, None) for an unconstrained request."""
    requested = _requested(request)
    if not requested:
        return None, None
    if len(requested) > 1:
        fields = ", ".join(field for field, _ in requested)
        raise OpenAIError(
            f"only one way to constrain the output may be used per request, got {fields}", 400, requested[1][0]
        )
    field, kwargs = requested[0]
    is_json = kwargs.get("json") is not None or bool(kwargs.get("json_object"))
    kwargs.update(_whitespace(request, is_json))
    try:
        return StructuredOutputsParams(**kwargs), field
    except ValueError as e:
        raise OpenAIError(str(e), 400, field) from e


def _whitespace(request: SamplingFields, is_json: bool) -> dict[str, Any]:
    """The request's JSON whitespace choice (structured_outputs' own fields, or
    guided_whitespace_pattern), else the server's default for JSON grammars."""
    so = request.structured_outputs
    chosen: dict[str, Any] = {}
    if so is not None and so.disable_any_whitespace is not None:
        chosen["disable_any_whitespace"] = so.disable_any_whitespace
    pattern = (
        so.whitespace_pattern
        if so is not None and so.whitespace_pattern is not None
        else request.guided_whitespace_pattern
    )
    if pattern is not None:
        chosen["whitespace_pattern"] = pattern
    if chosen or not is_json:
        return chosen
    defaults = request._structured_outputs_defaults
    if defaults is None:
        return {}
    return {
        "disable_any_whitespace": defaults.disable_any_whitespace,
        "whitespace_pattern": defaults.whitespace_pattern,
    }


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
