"""Suffix decoding (vLLM's method "suffix", after Arctic Inference): drafts
from the outputs of earlier requests, for traffic that repeats itself
(agents calling the same tools, the same questions asked again).

Earlier outputs are kept as a table of contexts, the n tokens before an
output token (n from the shortest lookup length up to MAX_CONTEXT), each with
how often every token followed it: a suffix tree cut at that depth, which is
all the drafting walks. A draft follows, token by token, the most frequent
continuation of the longest context that matches the end of the request's
tokens (and of the draft so far). Where earlier outputs know nothing, the
request's own tokens are looked up as method ngram does.

The table is kept per cache_salt: a request's drafts, and so its speed,
depend only on outputs of requests with its own salt (the prefix cache's
rule), so acceptance timing reveals nothing across tenants. It is bounded:
MAX_CONTEXTS contexts in all, the least recently extended dropped first.
"""

from __future__ import annotations

from collections import OrderedDict

from raylm.core.request import Request, RequestStatus
from raylm.core.spec_propose import prompt_lookup

# Longest context matched against earlier outputs.
MAX_CONTEXT = 8
# Contexts kept, all salts together: each a tuple of up to MAX_CONTEXT + 1
# items and a dict of a few counts, about 500 bytes, so ~50 MB at most; a
# 128-token output adds up to ~900 (one per token and context length).
MAX_CONTEXTS = 100_000


class SuffixProposer:
    def __init__(self, min_n: int, max_n: int, max_contexts: int = MAX_CONTEXTS):
        self.min_n = min_n  # the shortest context, and lookup's bounds in the request's own tokens
        self.max_n = max_n
        self.max_context = max(MAX_CONTEXT, min_n)
        self.max_contexts = max_contexts
        # ((cache_salt, adapter digest), *context) -> {next token: times
        # seen}, least recently extended first. Per adapter too: an
        # adapter's outputs are another model's, and its own tenant's.
        self._table: OrderedDict[tuple, dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        tokens = request.all_token_ids
        draft = self._follow_earlier_outputs(tokens, _table_key(request), max_tokens)
        return draft or prompt_lookup(tokens, max_tokens, self.min_n, self.max_n)

    def request_finished(self, request: Request) -> None:
        """Learn the request's output (not an errored one's): each output
        token after each of its contexts."""
        if request.status == RequestStatus.FINISHED_ERROR or not request.output_token_ids:
            return
        tokens, salt = request.all_token_ids, _table_key(request)
        for i in range(max(request.num_prompt_tokens, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_context, i) + 1):
                key = (salt, *tokens[i - n : i])
                counts = self._table.get(key)
                if counts is None:
                    counts = self._table[key] = {}
                else:
                    self._table.move_to_end(key)
                counts[tokens[i]] = counts.get(tokens[i], 0) + 1
        while len(self._table) > self.max_contexts:
            self._table.popitem(last=False)

    def _follow_earlier_outputs(self, tokens, salt, max_tokens: int) -> list[int]:
        context = list(tokens[-self.max_context :])
        draft: list[int] = []
        while len(draft) < max_tokens:
            token = self._most_frequent_next(salt, context)
            if token is None:
                break
            draft.append(token)
            context = context[1:] + [token] if len(context) == self.max_context else context + [token]
        return draft

    def _most_frequent_next(self, salt, context: list[int]) -> int | None:
        for n in range(min(len(context), self.max_context), self.min_n - 1, -1):
            counts = self._table.get((salt, *context[-n:]))
            if counts:
                # Ties go to the smallest id: the same table always drafts the same.
                return max(counts, key=lambda t: (counts[t], -t))
        return None


def _table_key(request: Request) -> tuple[str | None, str | None]:
    """Whose earlier outputs a request may follow: its salt's, under its adapter."""
    return request.cache_salt, request.lora_digest
