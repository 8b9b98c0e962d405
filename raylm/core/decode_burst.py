"""Decode bursts: several decode steps handed out by one schedule().

A decode step of a small model computes for less time than the engine spends
around it: scheduling, the step's messages to the workers, the scheduler's
update and the front end's output processing (on the ~7M benchmark model
0.2-0.3 ms of Python a step, about as long as its layers take). When every
running request is decoding and none waits for a seat, the scheduler can hand
out k steps at once: the workers run them in a row, each step's sampled tokens
the next step's input (raylm.worker.model_runner), and report each request's k
tokens together. The tokens are those k single steps would give: the same
kernels, the same sampler, the same sampling inputs, the same seeded
generators, called in the same order.

A request that needs the engine between two of its tokens is never in a burst
(then the step is a single one):
- a stop string (found on detokenized text, by the front end);
- logprobs (entries per token);
- a grammar (its matcher accepts each token in the scheduler);
- sampling that reads the output so far (penalties, bad words, min_tokens);
- random sampling without a seed, when more than one worker samples: each
  worker feeds its own sampled token into its next step, so they must all draw
  the same one, which a request's own seeded generator guarantees.

Stop tokens and EOS are seen by the scheduler as the tokens arrive: tokens
after one are dropped, computed in vain (at most k - 1 steps of one request).

How long: at most `num_scheduler_steps`, at most each request's remaining
max_tokens and room to max_model_len, and only as many steps as take about
the budget (SchedulerConfig.decode_burst_budget_s) at the pace of the last
decode steps, measured with as many rows or more (after requests join, one
single step measures the new pace first). A request that arrives during a
burst waits for its end to start, a finished request's seat stays empty until
then, and an abort waits as long. Offline (LLM.generate) every request is
queued before the first step and none is aborted, so a burst holds nobody
back: 8 steps within 50 ms by default. A server runs single steps unless told
otherwise (measured on 2 cores, where its front end shares the cores with the
engine, bursts cost throughput and TTFT), and then keeps the budget at 10 ms;
where steps are longer than the budget there is no burst at all (the share of
time a burst saves is largest where steps are shortest).
"""

from __future__ import annotations

from collections.abc import Callable

from raylm.core.request import Request
from raylm.messages import SchedulerOutput
from raylm.sampling_params import SamplingParams


def can_burst(params: SamplingParams, constrained: bool, workers_sample_alike: bool) -> bool:
    """Whether a request's tokens can come k at a time (see the module's docstring)."""
    if constrained or params.stop or params.logprobs is not None or params.prompt_logprobs is not None:
        return False
    if params.reads_own_output:
        return False
    return params.greedy or params.seed is not None or workers_sample_alike


class BurstPlanner:
    """Decides each step's burst length from the requests and the pace of the
    last decode steps (observe)."""

    @classmethod
    def for_engine(cls, config) -> BurstPlanner:
        """Decode bursts run where a step's sampled tokens are at hand for the
        next step's input: one pipeline stage, no context parallelism (whose
        ranks split a step's rows), and steps scheduled one at a time."""
        pc, sc = config.parallel_config, config.scheduler_config
        runs = pc.pipeline_parallel_size == 1 and pc.context_parallel_size == 1 and not sc.async_scheduling
        return cls(
            sc.num_scheduler_steps if runs else 1,
            sc.decode_burst_budget_s,
            workers_sample_alike=pc.tensor_parallel_size == 1,
        )

    def __init__(self, max_steps: int, budget_s: float, workers_sample_alike: bool):
        # 1: bursts off (the config says so, or the layout cannot run them).
        self.max_steps = max_steps
        self.budget_s = budget_s  # the longest a burst should take
        # One worker samples (no pipeline, tensor or context parallelism).
        self.workers_sample_alike = workers_sample_alike
        # One decode step's time, from the last decode-only step, and its rows.
        self.step_seconds: float | None = None
        self.step_rows = 0
        self.num_bursts = 0  # bursts run, and their steps in all
        self.num_burst_steps = 0

    def observe(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """A step's execution time (forward and sampling of all its steps)."""
        if scheduler_output.num_decode_steps > 1:
            self.num_bursts += 1
            self.num_burst_steps += scheduler_output.num_decode_steps
        counts = scheduler_output.num_scheduled_tokens
        if counts and all(n == 1 for n in counts.values()):
            self.step_seconds = seconds / scheduler_output.num_decode_steps
            self.step_rows = len(counts)

    def length(
        self, scheduled: list[tuple[Request, int]], max_model_len: int, is_constrained: Callable[[str], bool]
    ) -> int:
        """Steps for these (request, tokens scheduled) of a step: 1 unless all can burst."""
        if self.max_steps <= 1 or not scheduled or self.step_seconds is None:
            return 1
        if len(scheduled) > self.step_rows:
            # More rows than the measured pace had (requests just admitted): a
            # step of these takes longer. One single step measures it first.
            return 1
        steps = min(self.max_steps, int(self.budget_s / max(self.step_seconds, 1e-6)))
        for request, num_new in scheduled:
            if num_new != 1 or request.num_computed_tokens != request.num_tokens - 1:
                return 1  # a prefill (or a chunk of one) is in the step
            params = request.sampling_params
            if not can_burst(params, is_constrained(request.request_id), self.workers_sample_alike):
                return 1
            if params.max_tokens is not None:
                steps = min(steps, params.max_tokens - request.num_output_tokens)
            steps = min(steps, max_model_len - request.num_tokens)
            if steps <= 1:
                return 1
        return steps
