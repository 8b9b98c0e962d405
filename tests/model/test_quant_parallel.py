"""Quantized weights split over tensor-parallel workers (mp processes and Ray
actors), and data-parallel replicas of a quantized model: GGUF blocks are
sharded on block boundaries, int8 by rows and columns; the oracle is transformers greedy-decoding the float weights the
quantized ones stand for. A tensor-parallel size that would cut a block is
refused before any worker starts."""

from __future__ import annotations

import os

import psutil
import pytest

from raylm import LLM, SamplingParams
from raylm.distributed.shm_broadcast import SEGMENT_PREFIX
from raylm.testing.gguf_writer import write_dequantized_reference, write_gguf
from raylm.testing.hf_oracle import hf_greedy
from raylm.testing.int8_reference import write_int8_reference
from tests.conftest import our_live_ray_state, wait_until

# Row-parallel inputs of 512 and 1024 columns: halves of whole Q4_K blocks (256).
WIDE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2)
NARROW = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [[1, 17, 300, 5, 42], [1, 99, 640, 7, 3, 250, 11, 500, 23]]
MAX_TOKENS = 6
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, num_threads=1, tensor_parallel_size=2)


def q4_k_m(name: str, shape) -> str:
    return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"


def _generate(model: str, **engine) -> list[list[int]]:
    """Greedy tokens of PROMPTS on a TP=2 engine, which leaves no worker process,
    shared-memory segment or Ray actor behind."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    segments_before = set(os.listdir("/dev/shm"))
    with LLM(model, **{**ENGINE, **engine}) as llm:
        outputs = [
            list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        ]
        new_children = {p.pid for p in psutil.Process().children(recursive=True)} - children_before
    if engine.get("distributed_executor_backend") == "ray":
        wait_until(lambda: our_live_ray_state() == ([], []), within_s=60, message="Ray actors and groups gone")
    else:
        wait_until(
            lambda: not [pid for pid in new_children if _alive(pid) and not _is_resource_tracker(pid)],
            within_s=60,
            message="worker processes gone",
        )
    ours = tuple(f"{SEGMENT_PREFIX}{pid}_" for pid in new_children | {os.getpid()})
    assert [name for name in set(os.listdir("/dev/shm")) - segments_before if name.startswith(ours)] == []
    return outputs


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_resource_tracker(pid: int) -> bool:
    try:
        return any("multiprocessing.resource_tracker" in part for part in psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return False


def _expected(reference) -> list[list[int]]:
    return [g.token_ids for g in hf_greedy(reference, PROMPTS, MAX_TOKENS)]


@pytest.mark.parametrize("qtype,shape", [("Q8_0", NARROW), ("Q4_K_M", WIDE)])
def test_gguf_tp2_on_processes_matches_the_dequantized_model(qtype, shape, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLM_GGUF_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir("llama", **shape)
    chooser = q4_k_m if qtype == "Q4_K_M" else None
    path = write_gguf(folder, tmp_path / "m.gguf", qtype, tensor_type=chooser)
    reference = write_dequantized_reference(folder, tmp_path / "reference", qtype, tensor_type=chooser)
    assert _generate(str(path), distributed_executor_backend="mp") == _expected(reference)


def test_int8_tp2_on_processes_matches_the_dequantized_model(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("qwen2")
    reference = write_int8_reference(folder, tmp_path / "reference")
    assert _generate(folder, distributed_executor_backend="mp", quantization="int8") == _expected(reference)


def test_gguf_tp2_on_ray_matches_the_dequantized_model(ray_session, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLM_GGUF_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir("llama", **WIDE)
    path = write_gguf(folder, tmp_path / "m.gguf", tensor_type=q4_k_m)
    reference = write_dequantized_reference(folder, tmp_path / "reference", tensor_type=q4_k_m)
    assert _generate(str(path), distributed_executor_backend="ray") == _expected(reference)


# Pipeline stages load only their own layers' blocks (the embedding on the
# first, the norm and head on the last); greedy tokens cross the stage boundary.
PIPELINE = dict(tensor_parallel_size=1, pipeline_parallel_size=2)


@pytest.mark.parametrize("backend", ["mp", pytest.param("ray", marks=pytest.mark.ray)])
def test_gguf_pp2_matches_the_dequantized_model(backend, request, tiny_model_dir, tmp_path, monkeypatch):
    if backend == "ray":
        request.getfixturevalue("ray_session")
    monkeypatch.setenv("RAYLM_GGUF_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir("llama", **WIDE)
    path = write_gguf(folder, tmp_path / "m.gguf", tensor_type=q4_k_m)
    reference = write_dequantized_reference(folder, tmp_path / "reference", tensor_type=q4_k_m)
    assert _generate(str(path), distributed_executor_backend=backend, **PIPELINE) == _expected(reference)


def test_int8_pp2_on_processes_matches_the_dequantized_model(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("qwen2")
    reference = write_int8_reference(folder, tmp_path / "reference")
    assert _generate(folder, distributed_executor_backend="mp", quantization="int8", **PIPELINE) == _expected(reference)


def test_gguf_data_parallel_replicas_on_processes(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLM_GGUF_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir("llama", **NARROW)
    path = write_gguf(folder, tmp_path / "m.gguf", "Q8_0")
    reference = write_dequantized_reference(folder, tmp_path / "reference", "Q8_0")
    ours = _generate(str(path), tensor_parallel_size=1, data_parallel_size=2, data_parallel_backend="mp")
    assert ours == _expected(reference)


def test_a_split_inside_a_block_is_refused_before_workers_start(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLM_GGUF_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_model_dir("llama", **NARROW), tmp_path / "m.gguf", "Q4_K")
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size 2 would split tensor 'blk\.0\.attn_output\.weight' "
        r"\(Q4_K, 256 columns\) into shards of 128 columns",
    ):
        LLM(str(path), **ENGINE, distributed_executor_backend="mp")
