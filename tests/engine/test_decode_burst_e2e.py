"""Decode bursts end to end (raylm.core.decode_burst): an engine that runs
several decode steps per schedule gives the tokens, finish reasons and stop
reasons of the same engine scheduling every step (num_scheduler_steps=1) --
greedy and seeded random sampling, a stop token in the middle of a burst,
max_tokens that a burst length does not divide --
on the step-by-step path (float32), on the C++ one that runs a burst's greedy
steps in one call (bfloat16, each architecture, and GGUF-quantized weights),
and with two tensor-parallel workers."""

from __future__ import annotations

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.model.layers.cpu_kernels import get_cpu_kernels
from raylm.model.llama import LlamaForCausalLM
from raylm.testing.gguf_writer import write_gguf
from raylm.testing.tiny_models import SUPPORTED_ARCHS, make_tiny_model

PROMPTS = [[5, 9, 11], [7] * 12, [3, 4, 5, 6, 7], [20, 21], [40] * 3, [60, 61, 62, 63]]


def _params(stop_token: int | None) -> list[SamplingParams]:
    """max_tokens a burst of 8 does not divide; one request stops on a token
    that it samples mid-run; a seeded random row and an unseeded one."""
    return [
        SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, logit_bias={17: 0.5}),
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            ignore_eos=True,
            stop_token_ids=[stop_token] if stop_token is not None else None,
        ),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=29, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=31),  # EOS allowed
        # Unseeded: bursts with one worker (its tokens are not compared, see _compare).
        SamplingParams(temperature=0.7, max_tokens=26, ignore_eos=True),
    ]


def _generate(model, params, num_scheduler_steps, **engine_args):
    engine_args.setdefault("distributed_executor_backend", "uni")
    with LLM(
        str(model),
        kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=False,
        num_scheduler_steps=num_scheduler_steps,
        **engine_args,
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        core = llm.llm_engine.engine_core.engine_core
        planner = core.scheduler.burst_planner
        bursts = planner.num_bursts
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs], bursts


def _compare(model, **engine_args):
    # Which token stops request 2 mid-run: the one it samples 13th when nothing stops it.
    single, _ = _generate(model, _params(None), 1, **engine_args)
    stop_token = single[2][0][12]
    params = _params(stop_token)
    single, none = _generate(model, params, 1, **engine_args)
    burst, bursts = _generate(model, params, 8, **engine_args)
    assert none == 0
    assert bursts > 0, "no step ran as a burst"
    assert single[2][1] == "stop" and single[2][2] == stop_token
    # All but the unseeded random row, whose draws from the worker's generator
    # depend on the batch (a row stopped mid-burst computes to the burst's end).
    assert burst[:5] == single[:5]
    assert len(burst[5][0]) == len(single[5][0]) and burst[5][1:] == single[5][1:]
    return burst


def _count_greedy_calls(monkeypatch) -> list[bool]:
    """Whether each call of the model's greedy_decode_steps ran (True) or declined."""
    calls = []
    original = LlamaForCausalLM.greedy_decode_steps

    def counting(self, *args):
        out = original(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(LlamaForCausalLM, "greedy_decode_steps", counting)
    return calls


def test_bursts_equal_single_steps_step_by_step(tmp_path):
    model = make_tiny_model("llama", tmp_path / "m", seed=7)  # float32: each burst step runs from Python
    _compare(model)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_greedy_bursts_in_one_call_equal_single_steps(arch, tmp_path, monkeypatch):
    if get_cpu_kernels() is None:
        pytest.skip("no C++ compiler: the CPU kernels are not built")
    model = make_tiny_model(arch, tmp_path / arch, seed=3, dtype=torch.bfloat16)
    calls = _count_greedy_calls(monkeypatch)
    # Bursts of 4 rows or fewer: bfloat16 weights run the fused decode up to 4 rows.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (45, 19, 33, 8)]
    with LLM(
        str(model),
        dtype="bfloat16",
        kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
    ) as llm:
        burst = [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
        ]
    assert any(calls), "no burst ran its greedy steps in one call"
    with LLM(
        str(model),
        dtype="bfloat16",
        kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        num_scheduler_steps=1,
    ) as llm:
        single = [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
        ]
    assert burst == single


def test_quantized_greedy_bursts_in_one_call_equal_single_steps(tmp_path, monkeypatch):
    if get_cpu_kernels() is None:
        pytest.skip("no C++ compiler: the CPU kernels are not built")
    calls = _count_greedy_calls(monkeypatch)
    # Rows of 256 and 512 weights: whole K-quant super-blocks. A Q4_K_M-like mix.
    folder = make_tiny_model(
        "llama",
        tmp_path / "m",
        seed=9,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = write_gguf(
        folder,
        tmp_path / "m.gguf",
        "Q4_K",
        tensor_type=lambda name, shape: (
            "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"
        ),
    )
    _compare(path, dtype="bfloat16")
    assert any(calls), "no burst ran its greedy steps in one call (once the random rows are done)"


@pytest.mark.slow
def test_bursts_with_two_tensor_parallel_workers(tmp_path):
    """Each worker feeds its own sampled tokens into its next step: greedy and
    seeded rows draw the same on both. An unseeded random row keeps the steps
    single while it runs (checked with a short one: bursts come after it)."""
    model = make_tiny_model("qwen3", tmp_path / "m", seed=4)
    params = _params(None)
    params[5] = SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True)
    tp = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
    single, _ = _generate(model, params, 1, **tp)
    burst, bursts = _generate(model, params, 8, **tp)
    assert bursts > 0 and burst[:5] == single[:5]
