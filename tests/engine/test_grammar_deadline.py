"""A grammar that takes too long to compile ends its request with a clear
error ("grammar too complex", finish_reason "error"), while another
constrained request compiles beside it and completes. The engine's clock for
deadlines is stopped by the test, so nothing depends on the machine's speed."""

from __future__ import annotations

import threading

from raylm import LLM, SamplingParams
from raylm.sampling_params import StructuredOutputsParams


class _StoppedClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_too_slow_a_grammar_fails_its_request_and_only_it(tiny_model_dir):
    with LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_bytes=16 << 20) as llm:
        engine = llm.llm_engine
        manager = engine.engine_core.engine_core.scheduler.structured_output_manager
        manager._clock = clock = _StoppedClock()
        stuck, release = threading.Event(), threading.Event()
        compile_now = manager._make_matcher

        def compile_or_block(spec, prior):
            if "glacial" in spec.text:  # a compilation that outlives its deadline
                stuck.set()
                release.wait(120)
            return compile_now(spec, prior)

        manager._make_matcher = compile_or_block
        try:
            params = dict(temperature=0, max_tokens=16)
            engine.add_request(
                "slow",
                "Pick one:",
                SamplingParams(structured_outputs=StructuredOutputsParams(choice=["glacial"]), **params),
            )
            assert stuck.wait(60)
            engine.add_request(
                "fast",
                "Pick one:",
                SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), **params),
            )
            done = {}
            while "fast" not in done:
                done.update((o.request_id, o) for o in engine.step())
            assert done["fast"].outputs[0].text in ("yes", "no")
            assert done["fast"].outputs[0].finish_reason == "stop"
            assert "slow" not in done
            clock.now += manager.compile_timeout_s + 1
            while engine.has_unfinished_requests():
                done.update((o.request_id, o) for o in engine.step())
        finally:
            release.set()
    slow = done["slow"].outputs[0]
    assert slow.finish_reason == "error" and slow.token_ids == []
    assert slow.error == "structured_outputs.choice: grammar too complex: not compiled within 30 s"
