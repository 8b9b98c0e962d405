"""The `raylm` command line, run as a real subprocess on a tiny model: output
matches in-process `LLM.generate`, errors are one line, benchmarks write JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import raylm
from raylm import LLM, SamplingParams
from raylm.engine.arg_utils import EngineArgs, parse_bytes
from raylm.entrypoints.cli import _SEPARATOR, build_parser

PROMPTS = ["ROMEO:", "Hello there"]
MAX_TOKENS = 12
# One torch thread and a small KV cache: fast on a shared two-core machine.
ENGINE_FLAGS = ["--num-threads", "1", "--kv-cache-memory-bytes", "4MiB"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    # Bytes, not text mode: universal newlines would rewrite a generated "\r".
    return subprocess.run(
        [sys.executable, "-m", "raylm.entrypoints.cli", *args], capture_output=True, env=env, timeout=120
    )


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def expected_generate_stdout(model_dir) -> str:
    """What `raylm generate` must print, built from in-process generation."""
    with LLM(model=model_dir, num_threads=1, kv_cache_memory_bytes=4 << 20) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS or o.outputs[0].finish_reason == "stop" for o in outputs)
    return _SEPARATOR.join(f"{p}{t}\n" for p, t in zip(PROMPTS, texts))


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.decode().strip() == f"raylm {raylm.__version__}"


@pytest.mark.parametrize("command", [[], ["generate"], ["bench", "latency"], ["bench", "throughput"]])
def test_help_mentions_main_flags(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    if not command:
        for word in ("generate", "bench", "--version", "--dtype", "-tp"):
            assert word in text
        return
    for flag in (
        "--model",
        "--dtype",
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--distributed-executor-backend",
        "--ray-address",
        "--ray-placement-strategy",
        "--kv-cache-memory-bytes",
        "--no-enable-prefix-caching",
        "--max-model-len",
    ):
        assert flag in text, flag
    workload = {
        "generate": ("--max-tokens", "--temperature", "--top-p", "--top-k", "--stream"),
        "latency": (
            "--input-len",
            "--output-len",
            "--batch-size",
            "--num-iters-warmup",
            "--num-iters",
            "--output-json",
        ),
        "throughput": ("--input-len", "--output-len", "--num-prompts", "--output-json", "--disable-detokenize"),
    }[command[-1]]
    for flag in workload:
        assert flag in text, flag


def test_engine_flags_become_llm_kwargs():
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--model",
            "/m",
            "--dtype",
            "bfloat16",
            "-tp",
            "2",
            "-pp",
            "3",
            "--distributed-executor-backend",
            "ray",
            "--ray-address",
            "auto",
            "--ray-placement-strategy",
            "SPREAD",
            "--kv-cache-memory-bytes",
            "1.5GiB",
            "--no-enable-prefix-caching",
            "--max-model-len",
            "512",
        ]
    )
    kwargs = EngineArgs.from_cli_args(args).to_kwargs()
    assert kwargs["model"] == "/m" and kwargs["dtype"] == "bfloat16"
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["pipeline_parallel_size"] == 3
    assert kwargs["distributed_executor_backend"] == "ray" and kwargs["ray_address"] == "auto"
    assert kwargs["ray_placement_strategy"] == "SPREAD"
    assert kwargs["kv_cache_memory_bytes"] == 3 * 2**29
    assert kwargs["enable_prefix_caching"] is False and kwargs["max_model_len"] == 512
    # Unset optional flags are left for the engine to decide.
    assert kwargs["device"] is None and kwargs["num_threads"] is None
    assert parse_bytes("4096") == 4096 and parse_bytes("2G") == 2**31 and parse_bytes("512MiB") == 2**29


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
def test_generate_prints_what_llm_generates(model_dir, expected_generate_stdout, stream):
    result = run_cli(
        "generate",
        *PROMPTS,
        "--model",
        model_dir,
        "--temperature",
        "0",
        "--max-tokens",
        str(MAX_TOKENS),
        *ENGINE_FLAGS,
        *(["--stream"] if stream else []),
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    # Streaming prints the same deltas in order, so the whole text is identical.
    assert result.stdout.decode("utf-8") == expected_generate_stdout


def test_bad_model_path_is_a_one_line_error(tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "missing"))
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 2
    assert stderr.startswith("error: ") and "missing" in stderr
    assert "Traceback" not in stderr and stderr.count("\n") == 1


def test_bench_latency_writes_json(model_dir, tmp_path):
    out = tmp_path / "latency.json"
    result = run_cli(
        "bench",
        "latency",
        "--model",
        model_dir,
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--batch-size",
        "2",
        "--num-iters-warmup",
        "1",
        "--num-iters",
        "3",
        "--output-json",
        str(out),
        *ENGINE_FLAGS,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert "Avg latency:" in result.stdout.decode()
    data = json.loads(out.read_text())
    assert len(data["latencies"]) == len(data["ttfts"]) == 3
    for key in ("avg_latency", "p50_latency", "p90_latency", "p99_latency", "avg_ttft", "peak_rss_bytes"):
        assert data[key] > 0, key
    assert data["p50_latency"] <= data["p90_latency"] <= data["p99_latency"] <= max(data["latencies"])
    assert data["batch_size"] == 2 and data["output_len"] == 4


@pytest.mark.slow
def test_bench_throughput_writes_json(model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    num_prompts, input_len, output_len = 6, 20, 5
    result = run_cli(
        "bench",
        "throughput",
        "--model",
        model_dir,
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--num-prompts",
        str(num_prompts),
        "--output-json",
        str(out),
        "--disable-detokenize",
        *ENGINE_FLAGS,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert result.stdout.decode().startswith("Throughput: ")
    data = json.loads(out.read_text())
    assert data["detokenize"] is False
    for key in (
        "elapsed_time",
        "requests_per_second",
        "tokens_per_second",
        "output_tokens_per_second",
        "peak_rss_bytes",
    ):
        assert data[key] > 0, key
    # ignore_eos: every request produced exactly output_len tokens.
    assert data["num_output_tokens"] == num_prompts * output_len
    assert data["total_num_tokens"] == num_prompts * (input_len + output_len)
    assert data["tokens_per_second"] == pytest.approx(data["total_num_tokens"] / data["elapsed_time"])
    # All prompts are prefilled together, each holding ceil(20 / 16) = 2 blocks from then on.
    blocks_per_request = -(-input_len // data["block_size"])
    assert num_prompts * blocks_per_request <= data["peak_kv_cache_blocks"] <= data["num_kv_cache_blocks"]
