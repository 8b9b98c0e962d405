"""Output assembly: detokenize each request's new tokens, apply stop strings,
and build RequestOutputs (whole or as deltas for streaming).

Stop strings are found here, on text, because only the front end holds the
tokenizer; a request that hits one is reported back so the core aborts it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from raylm.core.outputs import EngineCoreOutput
from raylm.engine.detokenizer import IncrementalDetokenizer, detokenize_logprobs
from raylm.log_text import loggable
from raylm.messages import PositionLogprobsLists
from raylm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from raylm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ChildState:
    """One of a parent request's n completions (an engine-core request)."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, ChildState]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
    ) -> None:
        children = {}
        for i, cid in enumerate(child_ids):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop if params.detokenize else (),
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            children[cid] = ChildState(
                index=i,
                detokenizer=detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            self.child_to_parent[cid] = request_id
        self.parents[request_id] = ParentState(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            children,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []

    def _to_logprobs(self, entry: PositionLogprobsLists) -> PositionLogprobs:
        ids, lps, rank = entry
        texts = detokenize_logprobs(self.tokenizer, ids)
        out: PositionLogprobs = {}
        for j, (tid, lp, text) in enumerate(zip(ids, lps, texts)):
            if tid in out:
                continue
            # Column 0 is the chosen token with its true rank; then the top-k in order.
            out[tid] = Logprob(logprob=lp, rank=rank if j == 0 else j, decoded_token=text)
        return out

    def _add_prompt_logprobs(self, parent: ParentState, out: EngineCoreOutput) -> None:
        """Place prompt logprobs by the prompt token they score. After a
        recovery, or in a new core, the workers compute them again from the
        prompt's start: those already held are skipped, never appended twice."""
        held = len(parent.prompt_logprobs)
        if out.prompt_logprobs_start > held:
            # Positions before these never arrived: placing these would shift them.
            logger.error(
                "request %s: prompt logprobs from token %d, but only %d held; dropped",
                loggable(parent.request_id),
                out.prompt_logprobs_start,
                held,
            )
            return
        new = out.new_prompt_logprobs[held - out.prompt_logprobs_start :]
        parent.prompt_logprobs.extend(self._to_logprobs(e) for e in new)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[set[str], list[str]]:
        """Apply core outputs; returns (parent ids that changed, child ids to abort)."""
        changed: set[str] = set()
        to_abort: list[str] = []
        for out in outputs:
            parent_id = self.child_to_parent.get(out.request_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            child = parent.children[out.request_id]
            changed.add(parent_id)
            parent.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs and parent.prompt_logprobs is not None and child.index == 0:
                self._add_prompt_logprobs(parent, out)
            if child.finish_reason is not None:
                continue
            child.token_ids.extend(out.new_token_ids)
            if child.logprobs is not None:
                for entry in out.new_logprobs:
                    child.logprobs.append(self._to_logprobs(entry))
                    child.cumulative_logprob += entry[1][0]
            stop_str = None
            if parent.params.detokenize:
                stop_str = child.detokenizer.update(out.new_token_ids)
            if stop_str is not None:
                # The output ends with the token that completed the stop string,
                # as it would one token per step.
                past = child.detokenizer.num_tokens_past_stop
                if past:
                    del child.token_ids[-past:]
                    if child.logprobs is not None:
                        for entry in out.new_logprobs[-past:]:
                            child.cumulative_logprob -= entry[1][0]
                        del child.logprobs[len(child.token_ids) :]
                child.finish_reason, child.stop_reason = "stop", stop_str
                if not out.finished:
                    to_abort.append(out.request_id)
            elif out.finished:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
                child.error = out.error
        return changed, to_abort

    def resume_points(self, request_id: str) -> list[tuple[str, list[int]]]:
        """(child id, tokens generated so far) of each unfinished child, for
        resubmitting it to a new engine core as a continuation."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        # Prompt logprobs held stay: the new core sends them all again, and
        # those already here are skipped (_add_prompt_logprobs).
        return [(cid, list(child.token_ids)) for cid, child in parent.children.items() if child.finish_reason is None]

    def make_output(self, request_id: str, delta: bool = False) -> RequestOutput:
        """The parent's RequestOutput; `delta` gives only what is new since the last call."""
        parent = self.parents[request_id]
        completions = []
        for child in parent.children.values():
            finished = child.finish_reason is not None
            text = child.detokenizer.get_next_output_text(finished, delta) if parent.params.detokenize else ""
            tokens, logprobs = child.token_ids, child.logprobs
            if delta:
                tokens = tokens[child.sent_tokens :]
                if logprobs is not None:
                    logprobs = logprobs[child.sent_logprobs :]
                child.sent_tokens = len(child.token_ids)
                child.sent_logprobs = len(child.logprobs or [])
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=text,
                    token_ids=list(tokens),
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                    error=child.error,
                )
            )
        finished = parent.finished
        output = RequestOutput(
            request_id=request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=parent.prompt_logprobs,
            metrics={"num_cached_tokens": parent.num_cached_tokens},
        )
        if finished:
            self._remove(request_id)
        return output

    def abort(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        self._remove(request_id)
        return list(parent.children)

    def _remove(self, request_id: str) -> None:
        parent = self.parents.pop(request_id)
        for cid in parent.children:
            self.child_to_parent.pop(cid, None)
