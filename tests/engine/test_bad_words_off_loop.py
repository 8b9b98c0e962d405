"""AsyncLLM finishes a request's params (bad_words tokenized twice each, every
id checked, the params copied) off the event loop when the bad words are
many, as it tokenizes long prompts; a few are done on the loop, where the
hop to a thread would cost more than the work."""

from __future__ import annotations

import asyncio
import threading

from raylm.sampling_params import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_BAD_WORDS_TOTAL_CHARS, SamplingParams


def _threads_finishing(engine, monkeypatch, params: SamplingParams, prompt="a short prompt") -> list[str]:
    seen: list[str] = []
    finish = engine.input_processor.finish_params

    def recording(p):
        seen.append(threading.current_thread().name)
        return finish(p)

    monkeypatch.setattr(engine.input_processor, "finish_params", recording)

    async def run():
        loop_thread = threading.current_thread().name
        processed, finished = await engine.process_prompt(prompt, params)
        return loop_thread, processed, finished

    loop_thread, processed, finished = asyncio.run(run())
    assert processed.prompt_token_ids
    return ["loop" if name == loop_thread else "thread" for name in seen], finished


def test_many_bad_words_are_finished_in_a_thread(make_engine, monkeypatch):
    engine, _ = make_engine()
    # Up to the caps: as many words as allowed, as long as the total allows.
    length = min(MAX_BAD_WORD_CHARS, MAX_BAD_WORDS_TOTAL_CHARS // MAX_BAD_WORDS) - 5
    words = [f"w{i:04d}" + "x" * length for i in range(MAX_BAD_WORDS)]
    where, finished = _threads_finishing(engine, monkeypatch, SamplingParams(bad_words=words))
    assert where == ["thread"]
    assert finished.bad_words_token_ids == engine.input_processor._tokenize_bad_words(words)


def test_pretokenized_bad_words_up_to_the_caps_are_finished_in_a_thread(make_engine, monkeypatch):
    engine, _ = make_engine()
    params = SamplingParams(bad_words=["x"] * MAX_BAD_WORDS)
    params.bad_words_token_ids = [[7, 8, 9, 10]] * 2 * MAX_BAD_WORDS  # as a server tokenized them
    where, _ = _threads_finishing(engine, monkeypatch, params)
    assert where == ["thread"]


def test_a_few_bad_words_are_finished_on_the_loop(make_engine, monkeypatch):
    engine, _ = make_engine()
    where, finished = _threads_finishing(engine, monkeypatch, SamplingParams(bad_words=["hello", "world"]))
    assert where == ["loop"] and finished.bad_words_token_ids
