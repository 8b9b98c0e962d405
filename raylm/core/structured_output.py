"""Structured outputs: a request's tokens held to a grammar (JSON schema, any
JSON object, regex, choice, EBNF), with xgrammar.

The StructuredOutputManager sits beside the scheduler in the engine core. It
compiles each constrained request's grammar on a small pool of background
threads (raylm.core.grammar_pool; the step loop never waits for a compiler, nor sees its errors: a
grammar that fails there fails its request, and one that takes longer than
its deadline fails it as too complex; a slow grammar never holds up the
others), keeps one GrammarMatcher per request, advanced over
the output tokens the scheduler accepts, and fills a step's token bitmask
while the forward runs; the sampling rank applies it (docs/architecture.md, "One
step's data flow"). The matcher lives here, not on the workers, and counts the tokens it
has accepted, so it survives preemption, an executor rebuilt after a failure
(tokens of lost steps never reached it) and a request resumed with the tokens
it generated elsewhere (fast-forwarded over them once compiled).

JSON grammars bound their whitespace and digits (raylm.core.json_grammar). A
reasoning model's request may hold its grammar back until the output has
produced given tokens (the end of its thinking): until then the request gets
no bitmask row and its matcher is not fed.

xgrammar is imported on first use: engines without constrained requests never
load it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from raylm.core.grammar_pool import CompilePool
from raylm.core.json_grammar import BOUNDED_JSON_WHITESPACE, json_grammar_ebnf
from raylm.core.request import Request, RequestStatus
from raylm.messages import GrammarOutput, SchedulerOutput
from raylm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (xgrammar's own cache, keyed by the spec).
_COMPILER_CACHE_BYTES = 512 << 20
# Threads one compilation may use; the model needs the cores more.
_COMPILER_THREADS = 2
# Compilations that may run side by side: one slow grammar leaves the others
# a worker.
_COMPILE_WORKERS = max(2, min(4, os.cpu_count() or 1))
# How long a grammar may take to compile, from when a worker starts on it
# (not from when it was queued: waiting behind others is not its fault).
GRAMMAR_COMPILE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GrammarSpec:
    """A request's grammar as xgrammar compiles it, which is also its cache key."""

    field: str  # the StructuredOutputsParams field it came from, for errors
    kind: str  # "json_schema", "regex" or "ebnf"
    text: str
    # json_schema only: a regex for the whitespace between tokens, or None for none at all.
    whitespace: str | None = BOUNDED_JSON_WHITESPACE


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    if params.disable_any_whitespace:
        whitespace = None
    elif params.whitespace_pattern is not None:
        whitespace = params.whitespace_pattern
    else:
        whitespace = BOUNDED_JSON_WHITESPACE
    if params.json is not None:
        # Not sort_keys: the schema's property order is the output's.
        text = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return GrammarSpec("json", "json_schema", text, whitespace)
    if params.json_object:
        return GrammarSpec("json_object", "json_schema", '{"type": "object"}', whitespace)
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

    if spec.kind == "json_schema" and spec.whitespace not in (None, BOUNDED_JSON_WHITESPACE):
        try:
            xgr.Grammar.from_regex(spec.whitespace)
        except Exception as e:
            return f"whitespace_pattern: {_xgrammar_message(e) or type(e).__name__}"
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_ebnf(json_grammar_ebnf(spec.text, spec.whitespace))
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.text)
    except Exception as e:  # xgrammar raises RuntimeError (and others) for a bad spec
        return _xgrammar_message(e) or type(e).__name__
    return None


# The ints the engine's messages carry (msgpack): a JSON schema holding a
# larger one could not reach the engine core or its workers.
_INT_RANGE = (-(2**63), 2**63 - 1)


def _int_out_of_range(value: Any) -> int | None:
    """The first int in a JSON value past 64 bits, or None."""
    if type(value) is int:
        return None if _INT_RANGE[0] <= value <= _INT_RANGE[1] else value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for item in items:
        found = _int_out_of_range(item)
        if found is not None:
            return found
    return None


def _params_problem(params: StructuredOutputsParams) -> str | None:
    too_big = _int_out_of_range(params.json) if isinstance(params.json, dict) else None
    if too_big is not None:
        return f"the schema holds the integer {too_big}, past the 64-bit range"
    return _spec_problem(grammar_spec(params))


def grammar_problem(params: StructuredOutputsParams) -> str | None:
    """xgrammar's message for a grammar it cannot parse (or one holding an
    integer the engine cannot carry), or None when it parses; for callers
    that report the error under their own field name (the OpenAI server:
    response_format, guided_json, ...)."""
    return _params_problem(params)


def validate_structured_outputs(params: StructuredOutputsParams | None) -> None:
    """At request intake: ValueError (xgrammar's message) for a grammar that
    cannot be parsed, before the request reaches the engine. Tokenizer-free,
    so it runs wherever requests come in."""
    if params is not None:
        problem = _params_problem(params)
        if problem is not None:
            raise ValueError(f"structured_outputs.{grammar_spec(params).field} is invalid: {problem}")


class GrammarError(Exception):
    """A request's grammar could not be compiled, or refused a token."""


@dataclass
class _RequestGrammar:
    spec: GrammarSpec
    # Output tokens looked at: accepted by the matcher, or passed while the
    # grammar had not started yet (a reasoning model's thinking).
    num_accepted: int
    # The tokens after which the grammar starts (StructuredOutputsParams.starts_after_token_ids),
    # and whether the output has produced them yet.
    starts_after: list[int] | None = None
    started_output: bool = True
    # The matcher, fast-forwarded over the tokens the request came with.
    ready: Future | None = None
    # When a worker started compiling it (the manager's clock), or None while queued.
    started: float | None = None


def _pass_until_start(grammar: _RequestGrammar, tokens: list[int]) -> None:
    """Moves past the output tokens before the grammar's start: once
    `starts_after` has been produced, the tokens after it are the grammar's."""
    gate = grammar.starts_after
    while not grammar.started_output and grammar.num_accepted < len(tokens):
        grammar.num_accepted += 1
        n = grammar.num_accepted
        if n >= len(gate) and tokens[n - len(gate) : n] == gate:
            grammar.started_output = True


def _tokens_before_start(grammar: _RequestGrammar, output: list[int], draft: list[int]) -> int:
    """How many of a draft's first tokens leave a grammar that has not
    started (a reasoning model's thinking) still not started."""
    gate = grammar.starts_after
    tokens = list(output)
    for i, token_id in enumerate(draft):
        tokens.append(token_id)
        if len(tokens) >= len(gate) and tokens[-len(gate) :] == gate:
            return i
    return len(draft)


def _walk_draft(matcher, draft: list[int], bitmask=None, first: int = 0) -> int:
    """How many of the draft's first tokens the grammar allows, short of its
    end: the matcher advanced over them, then rolled back. With a bitmask,
    row first + j gets the tokens allowed after the first j."""
    if bitmask is not None:
        matcher.fill_next_token_bitmask(bitmask, first)
    accepted = allowed = 0
    for token_id in draft:
        if not matcher.accept_token(token_id):
            break
        accepted += 1
        if matcher.is_terminated():
            break
        allowed = accepted
        if bitmask is not None:
            matcher.fill_next_token_bitmask(bitmask, first + accepted)
    if accepted:
        matcher.rollback(accepted)
    return allowed


def _fill_draft_rows(rid: str, matcher, draft: list[int], bitmask, first: int) -> None:
    """Bitmask rows first .. first + len(draft): row first + j holds the
    tokens allowed after the draft's first j tokens."""
    filled = _walk_draft(matcher, draft, bitmask, first)
    if filled < len(draft):
        # Never expected (fit_draft cut the draft). Row `filled` forbids the
        # draft's token there, or that token ends the grammar and the request
        # with it: no token sampled after it is kept, any allowed tokens do.
        logger.error("request %s: a draft token past its grammar (rows after it copied)", rid)
        bitmask[first + filled + 1 : first + len(draft) + 1] = bitmask[first + filled]


class StructuredOutputManager:
    """Grammars, matchers and bitmasks of the constrained requests. Used by
    the scheduler (requests in and out, tokens accepted) and the engine core
    (a step's GrammarOutput); all on the step loop's thread except the
    compilations."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`clock`: what deadlines are measured with (tests stop it)."""
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._clock = clock
        self._grammars: dict[str, _RequestGrammar] = {}
        # Requests whose compilation has not been looked at since it ended.
        self._unchecked: set[str] = set()
        self._pool = CompilePool(_COMPILE_WORKERS)
        # Built by the first compilation; xgrammar's compiler is thread-safe.
        self._compiler = None
        self._compiler_lock = threading.Lock()

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        prior = list(request.output_token_ids)
        grammar = _RequestGrammar(
            grammar_spec(params), 0, params.starts_after_token_ids, params.starts_after_token_ids is None
        )
        # The tokens the request came with, up to the grammar's start (cheap, here) ...
        _pass_until_start(grammar, prior)
        # ... and the rest fast-forwarded once compiled.
        constrained_prior = prior[grammar.num_accepted :]
        grammar.num_accepted = len(prior)
        grammar.ready = self._pool.submit(self._compile, grammar, constrained_prior)
        self._grammars[request.request_id] = grammar
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
        compiled (or refused the tokens it came with), or was not compiled
        within the deadline, since the last call."""
        failed = []
        now = self._clock()
        for rid in list(self._unchecked):
            grammar = self._grammars[rid]
            if grammar.ready.done():
                self._unchecked.discard(rid)
                error = grammar.ready.exception()
                if error is not None:
                    failed.append((rid, str(error)))
            elif grammar.started is not None and now - grammar.started > self.compile_timeout_s:
                self._unchecked.discard(rid)
                self._pool.abandon(grammar.ready)
                failed.append(
                    (
                        rid,
                        f"structured_outputs.{grammar.spec.field}: grammar too complex: not "
                        f"compiled within {self.compile_timeout_s:g} s",
                    )
                )
        return failed

    def wait_for_compilation(self, timeout: float) -> None:
        """Let the compiler thread work rather than spin, when only requests
        waiting for their grammar are left."""
        pending = [g.ready for g in self._grammars.values() if not g.ready.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- compilation (on the pool's threads) ---------------------------------

    def _compile(self, grammar: _RequestGrammar, prior_tokens: list[int]):
        grammar.started = self._clock()
        return self._make_matcher(grammar.spec, prior_tokens)

    def _get_compiler(self, xgr):
        # The tokenizer is loaded once, by whichever compilation comes first.
        with self._compiler_lock:
            if self._compiler is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=_COMPILER_THREADS, cache_limit_bytes=_COMPILER_CACHE_BYTES
                )
            return self._compiler

    def _make_matcher(self, spec: GrammarSpec, prior_tokens: list[int]):
        xgr = _xgrammar()

        try:
            compiler = self._get_compiler(xgr)
            if spec.kind == "json_schema":
                compiled = compiler.compile_grammar(json_grammar_ebnf(spec.text, spec.whitespace))
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.text)
            else:
                compiled = compiler.compile_grammar(spec.text)
        except Exception as e:
            raise GrammarError(f"structured_outputs.{spec.field}: {_xgrammar_message(e)}") from None
        # Speculative drafts advance it and roll it back (fit_draft): rollback
        # is unbounded in xgrammar >= 0.2 (max_rollback_tokens is deprecated,
        # always -1), so there is no room to size for num_speculative_tokens.
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
        _pass_until_start(grammar, tokens)
        while grammar.num_accepted < len(tokens):
            token_id = tokens[grammar.num_accepted]
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                raise GrammarError(f"structured output: token {token_id} does not fit the request's grammar")
            grammar.num_accepted += 1
        return matcher.is_terminated()

    # ---- one step ------------------------------------------------------------

    def _sampling_rows(self, so: SchedulerOutput, requests: dict[str, Request]) -> Iterator[tuple[Request, int]]:
        """(request, end) for each live constrained request of the step, in
        batch order; `end` is how many of its tokens the step's forward covers,
        a speculative draft's not counted (they are not the request's tokens).
        A step samples a request's token at position `end` when `end` reaches
        its known tokens (and, with a draft, one after each draft token);
        past them, the step needs tokens still in flight (async scheduling),
        before them it computes a prefill chunk only."""
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        starts.update((r.req_id, r.num_computed_tokens) for r in so.scheduled_cached_reqs)
        for rid, num_tokens in so.num_scheduled_tokens.items():
            request = requests.get(rid)
            # Finished or preempted since it was scheduled: its token is dropped.
            if rid in self._grammars and request is not None and request.status == RequestStatus.RUNNING:
                yield request, starts[rid] + num_tokens - len(so.spec_token_ids.get(rid, ()))

    def needs_tokens_in_flight(self, so: SchedulerOutput, requests: dict[str, Request]) -> bool:
        """Whether a constrained request of this step samples after a token
        that an earlier step (still in flight) samples: its bitmask must wait."""
        return any(end > request.num_tokens for request, end in self._sampling_rows(so, requests))

    def grammar_output(self, so: SchedulerOutput, requests: dict[str, Request]) -> GrammarOutput | None:
        """The bitmask rows of the constrained requests that sample in this
        step (None when there are none). xgrammar is imported only once a
        constrained request is here: the import takes a fraction of a second,
        which would otherwise land on the first request a server answers."""
        rows: list[tuple[str, Any, list[int]]] = []
        for request, end in self._sampling_rows(so, requests):
            grammar = self._grammars[request.request_id]
            if end == request.num_tokens:
                if grammar.started_output:  # else free: the output has not reached the grammar's start
                    rows.append((request.request_id, grammar, so.spec_token_ids.get(request.request_id, [])))
            elif end > request.num_tokens:
                # Never expected: the engine waits for these tokens first.
                logger.error("request %s sampled unconstrained: its last token is unknown", request.request_id)
        if not rows:
            return None
        num_rows = [len(draft) + 1 for _, _, draft in rows]
        bitmask = _xgrammar().allocate_token_bitmask(sum(num_rows), self.vocab_size)
        first = 0
        for (rid, grammar, draft), count in zip(rows, num_rows):
            _fill_draft_rows(rid, grammar.ready.result(), draft, bitmask, first)
            first += count
        return GrammarOutput(
            req_ids=[rid for rid, _, _ in rows],
            bitmask=bitmask.numpy().tobytes(),
            num_words=bitmask.shape[1],
            num_rows=num_rows if len(num_rows) < sum(num_rows) else [],
        )

    # ---- speculative drafts --------------------------------------------------

    def fit_draft(self, request: Request, draft: list[int]) -> list[int]:
        """A constrained request's speculative draft, cut before its first
        token the grammar forbids (its row's mask would reject it, so no
        token after it could be committed) or that ends the grammar (the
        request stops there, and past its end a matcher has no mask); before
        the grammar's start, cut before the token that starts it (the rows
        after it would need the grammar). The matcher is advanced over the
        draft and rolled back: it stays at the committed tokens."""
        grammar = self._grammars[request.request_id]
        if not grammar.ready.done() or grammar.num_accepted != request.num_output_tokens:
            return []  # never expected: a step's tokens are all accepted before the next is scheduled
        if not grammar.started_output:
            return draft[: _tokens_before_start(grammar, request.output_token_ids, draft)]
        return draft[: _walk_draft(grammar.ready.result(), draft)]

    def shutdown(self) -> None:
        self._pool.shutdown()
