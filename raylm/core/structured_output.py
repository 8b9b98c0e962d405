"""Structured outputs: a request's tokens held to a grammar (JSON schema, any
JSON object, regex, choice, EBNF), with xgrammar.

The StructuredOutputManager sits beside the scheduler in the engine core. It
compiles each constrained request's grammar on a background thread (the step
loop never waits for a compiler, nor sees its errors: a grammar that fails
there fails its request), keeps one GrammarMatcher per request, advanced over
the output tokens the scheduler accepts, and fills a step's token bitmask
while the forward runs; the sampling rank applies it (DESIGN.md, "Structured
outputs"). The matcher lives here, not on the workers, and counts the tokens it
has accepted, so it survives preemption, an executor rebuilt after a failure
(tokens of lost steps never reached it) and a request resumed with the tokens
it generated elsewhere (fast-forwarded over them once compiled).

xgrammar is imported on first use: engines without constrained requests never
load it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from raylm.core.request import Request, RequestStatus
from raylm.messages import GrammarOutput, SchedulerOutput
from raylm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (xgrammar's own cache, keyed by the spec).
_COMPILER_CACHE_BYTES = 512 << 20
# Threads one compilation may use; the model needs the cores more.
_COMPILER_THREADS = 2


@dataclass(frozen=True)
class GrammarSpec:
    """A request's grammar as xgrammar compiles it, which is also its cache key."""

    field: str  # the StructuredOutputsParams field it came from, for errors
    kind: str  # "json_schema", "regex" or "ebnf"
    text: str
    any_whitespace: bool = True  # json_schema only


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    any_whitespace = not params.disable_any_whitespace
    if params.json is not None:
        # Not sort_keys: the schema's property order is the output's.
        text = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return GrammarSpec("json", "json_schema", text, any_whitespace)
    if params.json_object:
        return GrammarSpec("json_object", "json_schema", '{"type": "object"}', any_whitespace)
    if params.regex is not None:
        return GrammarSpec("regex", "regex", params.regex)
    if params.choice is not None:
        # JSON string literals are valid EBNF ones (same escapes).
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return GrammarSpec("choice", "ebnf", f"root ::= {alternatives}")
    return GrammarSpec("grammar", "ebnf", params.grammar)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError("structured outputs need the xgrammar package (pip install xgrammar)") from e
    return xgrammar


def _xgrammar_message(error: Exception) -> str:
    # "[12:00:00] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> the message.
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())


@functools.lru_cache(maxsize=256)
def _spec_problem(spec: GrammarSpec) -> str | None:
    """xgrammar's complaint about a spec, or None; cached either way (a
    server sees the same schema again and again)."""
    xgr = _xgrammar()

    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.text)
    except Exception as e:  # xgrammar raises RuntimeError (and others) for a bad spec
        return _xgrammar_message(e) or type(e).__name__
    return None


def grammar_problem(params: StructuredOutputsParams) -> str | None:
    """xgrammar's message for a grammar it cannot parse, or None when it
    parses; for callers that report the error under their own field name
    (the OpenAI server: response_format, guided_json, ...)."""
    return _spec_problem(grammar_spec(params))


def validate_structured_outputs(params: StructuredOutputsParams | None) -> None:
    """At request intake: ValueError (xgrammar's message) for a grammar that
    cannot be parsed, before the request reaches the engine. Tokenizer-free,
    so it runs wherever requests come in."""
    if params is not None:
        spec = grammar_spec(params)
        problem = _spec_problem(spec)
        if problem is not None:
            raise ValueError(f"structured_outputs.{spec.field} is invalid: {problem}")


class GrammarError(Exception):
    """A request's grammar could not be compiled, or refused a token."""


@dataclass
class _RequestGrammar:
    # The matcher, fast-forwarded over the tokens the request came with.
    ready: Future
    # Output tokens the matcher has accepted.
    num_accepted: int


class StructuredOutputManager:
    """Grammars, matchers and bitmasks of the constrained requests. Used by
    the scheduler (requests in and out, tokens accepted) and the engine core
    (a step's GrammarOutput); all on the step loop's thread except the
    compilations."""

    def __init__(self, tokenizer_path: str, vocab_size: int):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._grammars: dict[str, _RequestGrammar] = {}
        # Requests whose compilation has not been looked at since it ended.
        self._unchecked: set[str] = set()
        # One thread: compilations queue up, and the lazily built compiler
        # is only ever touched there.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="raylm-grammar")
        self._compiler = None

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        prior = list(request.output_token_ids)
        future = self._executor.submit(self._make_matcher, grammar_spec(params), prior)
        self._grammars[request.request_id] = _RequestGrammar(future, len(prior))
        self._unchecked.add(request.request_id)

    def remove_request(self, request_id: str) -> None:
        self._unchecked.discard(request_id)
        grammar = self._grammars.pop(request_id, None)
        if grammar is not None:
            grammar.ready.cancel()

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._grammars

    def is_compiling(self, request_id: str) -> bool:
        grammar = self._grammars.get(request_id)
        return grammar is not None and not grammar.ready.done()

    def failed_requests(self) -> list[tuple[str, str]]:
        """(request id, error) of each request whose grammar could not be
        compiled (or refused the tokens it came with) since the last call."""
        failed = []
        for rid in [rid for rid in self._unchecked if self._grammars[rid].ready.done()]:
            self._unchecked.discard(rid)
            error = self._grammars[rid].ready.exception()
            if error is not None:
                failed.append((rid, str(error)))
        return failed

    def wait_for_compilation(self, timeout: float) -> None:
        """Let the compiler thread work rather than spin, when only requests
        waiting for their grammar are left."""
        pending = [g.ready for g in self._grammars.values() if not g.ready.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- compilation (on the compiler thread) --------------------------------

    def _make_matcher(self, spec: GrammarSpec, prior_tokens: list[int]):
        xgr = _xgrammar()

        try:
            if self._compiler is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=_COMPILER_THREADS, cache_limit_bytes=_COMPILER_CACHE_BYTES
                )
            if spec.kind == "json_schema":
                compiled = self._compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.text)
            else:
                compiled = self._compiler.compile_grammar(spec.text)
        except Exception as e:
            raise GrammarError(f"structured_outputs.{spec.field}: {_xgrammar_message(e)}") from None
        matcher = xgr.GrammarMatcher(compiled)
        # A request resumed with tokens generated elsewhere continues after them.
        for i, token_id in enumerate(prior_tokens):
            if not matcher.accept_token(token_id):
                raise GrammarError(
                    f"structured_outputs.{spec.field}: output token {i} ({token_id}) does not fit the grammar"
                )
        return matcher

    # ---- tokens accepted -----------------------------------------------------

    def accept_tokens(self, request: Request) -> bool:
        """Advance the request's matcher over the output tokens it has not
        seen yet (each exactly once); True once its grammar is terminated.
        GrammarError if a token does not fit (its bitmask should have
        forbidden it)."""
        grammar = self._grammars[request.request_id]
        matcher = grammar.ready.result()  # done: the request was scheduled
        tokens = request.output_token_ids
        while grammar.num_accepted < len(tokens):
            token_id = tokens[grammar.num_accepted]
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                raise GrammarError(f"structured output: token {token_id} does not fit the request's grammar")
            grammar.num_accepted += 1
        return matcher.is_terminated()

    # ---- one step ------------------------------------------------------------

    def _sampling_rows(self, so: SchedulerOutput, requests: dict[str, Request]) -> Iterator[tuple[Request, int]]:
        """(request, end) for each live constrained request of the step, in
        batch order; `end` is how many of its tokens the step's forward covers.
        A step samples a request's token at position `end` when `end` reaches
        its known tokens; past them, the step needs tokens still in flight
        (async scheduling), before them it computes a prefill chunk only."""
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        starts.update((r.req_id, r.num_computed_tokens) for r in so.scheduled_cached_reqs)
        for rid, num_tokens in so.num_scheduled_tokens.items():
            request = requests.get(rid)
            # Finished or preempted since it was scheduled: its token is dropped.
            if rid in self._grammars and request is not None and request.status == RequestStatus.RUNNING:
                yield request, starts[rid] + num_tokens

    def needs_tokens_in_flight(self, so: SchedulerOutput, requests: dict[str, Request]) -> bool:
        """Whether a constrained request of this step samples after a token
        that an earlier step (still in flight) samples: its bitmask must wait."""
        return any(end > request.num_tokens for request, end in self._sampling_rows(so, requests))

    def grammar_output(self, so: SchedulerOutput, requests: dict[str, Request]) -> GrammarOutput | None:
        """The bitmask rows of the constrained requests that sample in this
        step (None when there are none). xgrammar is imported only once a
        constrained request is here: the import takes a fraction of a second,
        which would otherwise land on the first request a server answers."""
        rows: list[tuple[str, Any]] = []
        for request, end in self._sampling_rows(so, requests):
            if end == request.num_tokens:
                rows.append((request.request_id, self._grammars[request.request_id]))
            elif end > request.num_tokens:
                # Never expected: the engine waits for these tokens first.
                logger.error("request %s sampled unconstrained: its last token is unknown", request.request_id)
        if not rows:
            return None
        bitmask = _xgrammar().allocate_token_bitmask(len(rows), self.vocab_size)
        for i, (_, grammar) in enumerate(rows):
            grammar.ready.result().fill_next_token_bitmask(bitmask, i)
        return GrammarOutput(
            req_ids=[rid for rid, _ in rows], bitmask=bitmask.numpy().tobytes(), num_words=bitmask.shape[1]
        )

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
