"""JSON grammars that a weak model cannot spin in: the EBNF raylm compiles
for a JSON schema (or any JSON object), with the whitespace between tokens
and the digits of numbers bounded.

xgrammar's JSON-schema converter offers any whitespace, none (with fixed
separators), or at most N characters of [ \\n\\r\\t] between tokens, and
repeats digits without end. For a whitespace pattern (raylm's bounded
default, or a request's whitespace_pattern) the schema is converted with a
marker count, and each whitespace run the converter wrote is replaced by a
rule made from the pattern (xgrammar's own regex converter). EBNF string
literals and character classes are skipped, so a schema's enum, const or
pattern text is never touched.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

# What may stand between JSON tokens unless the request says otherwise: one
# space, or a newline and an indent of at most 20 (llama.cpp's bound). xgrammar
# allows any run of whitespace, which a weak model takes until max_tokens.
BOUNDED_JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"


_MARK_COUNT = 977
_WHITESPACE_RULE = "raylm_json_ws"
_EBNF_LITERAL = r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]'
_CONVERTER_RUN = re.compile(_EBNF_LITERAL + r"|(\bwhitespace(?:_\d+)?\{0, ?" + str(_MARK_COUNT) + r"\})")
# Digits too, as llama.cpp bounds them: at most 16 in an integer part (past
# that a double cannot hold it exactly anyway), a fraction or an exponent;
# xgrammar's basic number rules repeat digits without end.
_MAX_DIGITS = 16
_UNBOUNDED_DIGITS = re.compile(r"(\[0-9\]\*|\bbasic_number_digits\{1, ?-1\})|" + _EBNF_LITERAL)
_MARK = re.compile(_EBNF_LITERAL + r"|(\{0, ?" + str(_MARK_COUNT) + r"\})")
_REGEX_RULE_NAME = re.compile(_EBNF_LITERAL + r"|(\broot(?:_\d+)?\b)")


def _replace_outside_literals(pattern: re.Pattern, text: str, replace: Callable[[str], str]) -> tuple[str, int]:
    count = 0

    def substitute(match: re.Match) -> str:
        nonlocal count
        if match.group(1) is None:
            return match.group(0)  # a literal: kept as written
        count += 1
        return replace(match.group(1))

    return pattern.sub(substitute, text), count


def _whitespace_rules(pattern: str) -> str:
    """EBNF rules for the whitespace regex, the first named _WHITESPACE_RULE."""
    ebnf = str(_xgrammar_module().Grammar.from_regex(pattern))
    renamed, _ = _replace_outside_literals(_REGEX_RULE_NAME, ebnf, lambda name: _WHITESPACE_RULE + name[4:])
    return renamed


@functools.lru_cache(maxsize=256)
def json_grammar_ebnf(schema: str, whitespace: str | None) -> str:
    """The EBNF of JSON following `schema` with `whitespace` (a regex; None:
    none at all, "," and ":" alone separate) between its tokens, and numbers of
    at most _MAX_DIGITS digits a part. ValueError when the converter's output
    does not have the shape this rewrite knows (another xgrammar version)."""
    xgr = _xgrammar_module()
    if whitespace is None:
        rewritten = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":")))
    else:
        converted = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=_MARK_COUNT))
        rewritten, _ = _replace_outside_literals(_CONVERTER_RUN, converted, lambda _: _WHITESPACE_RULE)
        if _replace_outside_literals(_MARK, rewritten, str)[1]:  # a run left as the converter wrote it
            raise ValueError("xgrammar's JSON-schema converter wrote whitespace in a form raylm does not know")
        rewritten += _whitespace_rules(whitespace)
    rewritten, _ = _replace_outside_literals(_UNBOUNDED_DIGITS, rewritten, _bounded_digits)
    return rewritten


def _bounded_digits(run: str) -> str:
    if run.startswith("["):
        return f"[0-9]{{0, {_MAX_DIGITS - 1}}}"  # after a leading [1-9]
    return f"basic_number_digits{{1, {_MAX_DIGITS}}}"


def _xgrammar_module():
    import xgrammar  # first use only: engines without constrained requests never load it

    return xgrammar
