"""Every engine setting is declared once, on EngineArgs, and everything else
follows from that declaration: each setting has a flag on every command that
runs an engine, the flags' defaults are EngineArgs' defaults, which are what
the engine runs with when nothing is said, `--help` lists them, and a value
given as a flag arrives in the EngineConfig."""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields
from pathlib import Path

import pytest

import raylm
from raylm.config import CacheConfig, FaultToleranceConfig, ParallelConfig, SchedulerConfig, create_engine_config
from raylm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from raylm.entrypoints.cli import build_parser

# Settings no flag can carry; each says why in its declaration.
PROGRAM_ONLY = {"placement_group"}
FLAGGED = [f.name for f in fields(EngineArgs) if f.name not in PROGRAM_ONLY]
# Every command that runs (or plans) an engine, with its required arguments.
ENGINE_COMMANDS = [["generate", "x"], ["serve"], ["bench", "latency"], ["bench", "throughput"], ["plan"]]

# One value other than the default for every flag: what to type, what it means.
NON_DEFAULT = {
    "model": (["--model", "/m"], "/m"),
    "tokenizer": (["--tokenizer", "/t"], "/t"),
    "revision": (["--revision", "v2"], "v2"),
    "tokenizer_revision": (["--tokenizer-revision", "v3"], "v3"),
    "download_dir": (["--download-dir", "/cache"], "/cache"),
    "generation_config": (["--generation-config", "vllm"], "vllm"),
    "chat_template": (["--chat-template", "t.jinja"], "t.jinja"),
    "quantization": (["-q", "none"], "none"),
    "gguf_file": (["--gguf-file", "m.gguf"], "m.gguf"),
    "trust_remote_code": (["--trust-remote-code"], True),
    "dtype": (["--dtype", "float32"], "float32"),
    "max_model_len": (["--max-model-len", "0.3k"], 300),
    "seed": (["--seed", "7"], 7),
    "tensor_parallel_size": (["-tp", "2"], 2),
    "pipeline_parallel_size": (["-pp", "3"], 3),
    "context_parallel_size": (["-cp", "2"], 2),
    "distributed_executor_backend": (["--distributed-executor-backend", "ray"], "ray"),
    "data_parallel_size": (["-dp", "2"], 2),
    # The only choice there is, so it cannot differ from the default.
    "data_parallel_backend": (["--data-parallel-backend", "ray"], "ray"),
    "data_parallel_placement": (["--data-parallel-placement", "spread"], "spread"),
    "routing_policy": (["--routing-policy", "vllm"], "vllm"),
    "prefix_pull": (["--no-prefix-pull"], False),
    "prefill_replicas": (["--prefill-replicas", "1"], 1),
    "pd_min_prompt_tokens": (["--pd-min-prompt-tokens", "64"], 64),
    "pd_handoff_queue": (["--pd-handoff-queue", "3"], 3),
    "data_parallel_rebalance": (["--data-parallel-rebalance"], True),
    "autoscale": (["--autoscale", "1:3"], "1:3"),
    "autoscale_target_ongoing_requests": (["--autoscale-target-ongoing-requests", "4"], 4.0),
    "autoscale_upscale_delay": (["--autoscale-upscale-delay", "2.5"], 2.5),
    "autoscale_downscale_delay": (["--autoscale-downscale-delay", "60"], 60.0),
    "ray_address": (["--ray-address", "auto"], "auto"),
    "ray_placement_strategy": (["--ray-placement-strategy", "STRICT_SPREAD"], "STRICT_SPREAD"),
    "ray_placement_timeout": (["--ray-placement-timeout", "12.5"], 12.5),
    "ray_step_transport": (["--ray-step-transport", "cgraph"], "cgraph"),
    "kv_cache_memory_bytes": (["--kv-cache-memory-bytes", "4MiB"], 4 << 20),
    "block_size": (["--block-size", "32"], 32),
    "kv_offloading_size": (["--kv-offloading-size", "1.5"], 1.5),
    # One backend (vLLM's flag, accepted as vLLM users write it): its sample is the default.
    "kv_offloading_backend": (["--kv-offloading-backend", "native"], "native"),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "enforce_eager": (["--enforce-eager"], True),
    "max_num_seqs": (["--max-num-seqs", "4"], 4),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "1000"], 1000),
    "enable_chunked_prefill": (["--no-enable-chunked-prefill"], False),
    "async_scheduling": (["--async-scheduling"], True),
    "num_scheduler_steps": (["--num-scheduler-steps", "3"], 3),
    "device": (["--device", "cpu"], "cpu"),
    "num_threads": (["--num-threads", "1"], 1),
    "prefill_num_threads": (["--prefill-num-threads", "2"], 2),
    "autoscale_prefill": (["--autoscale-prefill", "1:2"], "1:2"),
    "autoscale_decode": (["--autoscale-decode", "2:3"], "2:3"),
    "decode_num_threads": (["--decode-num-threads", "3"], 3),
    "cpu_bind": (["--cpu-bind", "all"], "all"),
    "max_restarts": (["--max-restarts", "5"], 5),
    "restart_window": (["--restart-window", "100"], 100.0),
    "execute_model_timeout": (["--execute-model-timeout", "50"], 50.0),
    "engine_start_timeout": (["--engine-start-timeout", "40"], 40.0),
    "health_check_interval": (["--health-check-interval", "2"], 2.0),
    "health_check_timeout": (["--health-check-timeout", "7"], 7.0),
    "speculative_config": (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
        '{"method": "ngram", "num_speculative_tokens": 3}',
    ),
    "enable_lora": (["--enable-lora"], True),
    "max_loras": (["--max-loras", "4"], 4),
    "max_lora_rank": (["--max-lora-rank", "32"], 32),
    "max_cpu_loras": (["--max-cpu-loras", "8"], 8),
}


def test_every_setting_has_a_flag_with_help():
    for f in fields(EngineArgs):
        flag = EngineArgs.flag_of(f.name)
        if f.name in PROGRAM_ONLY:
            assert flag is None and f.metadata["raylm_no_flag"], f.name
        else:
            assert flag is not None and flag.help.strip(), f"{f.name} has no flag (or no help)"
    assert [f.name for f in fields(AsyncEngineArgs)] == [f.name for f in fields(EngineArgs)]


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=" ".join)
def test_every_engine_command_takes_every_flag_with_the_engine_args_default(command):
    args = build_parser().parse_args(command)
    missing = [name for name in FLAGGED if not hasattr(args, name)]
    assert not missing, f"raylm {' '.join(command)} has no flag for {missing}"
    expected = EngineArgs()
    if command == ["plan"]:
        # A dry run waits less for Ray to place the groups (its own flag).
        expected.ray_placement_timeout = 10.0
    differing = [name for name in FLAGGED if getattr(args, name) != getattr(expected, name)]
    assert not differing, f"flag defaults of raylm {' '.join(command)} differ from EngineArgs': {differing}"
    assert EngineArgs.from_cli_args(args) == expected


@pytest.mark.parametrize("command", [["generate"], ["serve"]], ids=" ".join)
def test_help_lists_every_flag(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in FLAGGED:
        for option in EngineArgs.flag_of(name).option_strings(name):
            assert option in text, option
    assert "--no-enable-chunked-prefill" in text and "--no-enable-prefix-caching" in text
    assert "(on by default)" in text


def test_every_flag_reaches_engine_args():
    assert sorted(NON_DEFAULT) == sorted(FLAGGED), "give each new setting a non-default value here"
    argv = [token for tokens, _ in NON_DEFAULT.values() for token in tokens]
    given = EngineArgs.from_cli_args(build_parser().parse_args(["generate", "x", *argv]))
    defaults = EngineArgs()
    for name, (tokens, expected) in NON_DEFAULT.items():
        assert getattr(given, name) == expected, (tokens, getattr(given, name))
        if name not in ("data_parallel_backend", "kv_offloading_backend"):
            assert expected != getattr(defaults, name), f"{name}: the sample value is the default"


def test_flags_round_trip_into_the_engine_config(tiny_model_dir, tmp_path):
    args = build_parser().parse_args(
        [
            "generate",
            "x",
            "--model",
            tiny_model_dir("llama"),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            "300",
            "--async-scheduling",
            "--ray-placement-timeout",
            "12.5",
            "--health-check-timeout",
            "7",
            "--health-check-interval",
            "2",
            "--max-restarts",
            "5",
            "--restart-window",
            "100",
            "--execute-model-timeout",
            "50",
            "-tp",
            "2",
            "--ray-step-transport",
            "cgraph",
            "--ray-placement-strategy",
            "SPREAD",
            "-dp",
            "2",
            "--data-parallel-placement",
            "spread",
            "--routing-policy",
            "load",
            "--block-size",
            "32",
            "--max-num-seqs",
            "4",
            "--cpu-bind",
            "all",
            "--kv-cache-memory-bytes",
            "4MiB",
        ]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    sc, pc, ft, cc = config.scheduler_config, config.parallel_config, config.fault_tolerance, config.cache_config
    assert (sc.enable_chunked_prefill, sc.async_scheduling, sc.max_num_batched_tokens) == (False, True, 300)
    assert sc.max_num_seqs == 4 and config.model_config.max_model_len == 256
    assert (pc.tensor_parallel_size, pc.ray_placement_timeout, pc.ray_step_transport) == (2, 12.5, "cgraph")
    assert (pc.ray_placement_strategy, pc.data_parallel_size, pc.data_parallel_placement) == ("SPREAD", 2, "spread")
    assert pc.routing_policy == "load"
    assert (ft.health_check_timeout_s, ft.health_check_interval_s, ft.max_restarts) == (7.0, 2.0, 5)
    assert (ft.restart_window_s, ft.execute_model_timeout_s) == (100.0, 50.0)
    assert (cc.block_size, cc.kv_cache_memory_bytes) == (32, 4 << 20) and config.cpu_bind == "all"
    # The newly flagged settings are still checked where they are resolved.
    with pytest.raises(ValueError, match="async_scheduling needs pipeline_parallel_size = 1"):
        EngineArgs.from_cli_args(
            build_parser().parse_args(
                [
                    "generate",
                    "x",
                    "--model",
                    tiny_model_dir("llama"),
                    "--async-scheduling",
                    "-pp",
                    "2",
                ]
            )
        ).create_engine_config()
    with pytest.raises(ValueError, match="health_check_timeout"):
        create_engine_config(tiny_model_dir("llama"), health_check_timeout=0)
    # Decode bursts by default offline, single steps serving (raylm.core.decode_burst).
    assert create_engine_config(tiny_model_dir("llama")).scheduler_config.num_scheduler_steps == 8
    served = create_engine_config(tiny_model_dir("llama"), usage_context="api_server").scheduler_config
    assert served.num_scheduler_steps == 1 and served.decode_burst_budget_s < 0.05
    for bad in (0, 65, 2.5, True):
        with pytest.raises(ValueError, match="num_scheduler_steps must be an integer from 1 to 64"):
            create_engine_config(tiny_model_dir("llama"), num_scheduler_steps=bad)


def test_nothing_said_is_what_engine_args_say(tiny_model_dir):
    """What the engine runs with when no setting is given equals EngineArgs'
    defaults, and the resolved configs' own defaults agree with them."""
    d = EngineArgs()
    config = create_engine_config(tiny_model_dir("llama"), device="cpu")
    resolved = {
        "seed": config.model_config.seed,
        "block_size": config.cache_config.block_size,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "async_scheduling": config.scheduler_config.async_scheduling,
        "num_threads": config.num_threads,
        "max_restarts": config.fault_tolerance.max_restarts,
        "restart_window": config.fault_tolerance.restart_window_s,
        "execute_model_timeout": config.fault_tolerance.execute_model_timeout_s,
        "engine_start_timeout": config.fault_tolerance.engine_start_timeout_s,
        "health_check_interval": config.fault_tolerance.health_check_interval_s,
        "health_check_timeout": config.fault_tolerance.health_check_timeout_s,
        **{
            name: getattr(config.parallel_config, name)
            for name in (
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "distributed_executor_backend",
                "ray_address",
                "ray_placement_strategy",
                "ray_placement_timeout",
                "ray_step_transport",
                "placement_group",
                "data_parallel_size",
                "data_parallel_backend",
                "data_parallel_placement",
                "routing_policy",
            )
        },
    }
    assert resolved == {name: getattr(d, name) for name in resolved}
    # Config objects built directly (by tests, by replicas) start from the same values.
    standalone = {
        "block_size": CacheConfig().block_size,
        "enable_prefix_caching": CacheConfig().enable_prefix_caching,
        "max_num_seqs": SchedulerConfig().max_num_seqs,
        "enable_chunked_prefill": SchedulerConfig().enable_chunked_prefill,
        "async_scheduling": SchedulerConfig().async_scheduling,
        "max_restarts": FaultToleranceConfig().max_restarts,
        "restart_window": FaultToleranceConfig().restart_window_s,
        "execute_model_timeout": FaultToleranceConfig().execute_model_timeout_s,
        "engine_start_timeout": FaultToleranceConfig().engine_start_timeout_s,
        "health_check_interval": FaultToleranceConfig().health_check_interval_s,
        "health_check_timeout": FaultToleranceConfig().health_check_timeout_s,
        **{
            name: getattr(ParallelConfig(), name)
            for name in (
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "ray_placement_strategy",
                "ray_placement_timeout",
                "ray_step_transport",
                "data_parallel_size",
                "data_parallel_backend",
                "data_parallel_placement",
            )
        },
    }
    assert standalone == {name: getattr(d, name) for name in standalone}
    # The unset ones, resolved from the model and the device.
    assert config.model_config.max_model_len == config.model_config.arch.max_position_embeddings
    assert config.cache_config.gpu_memory_utilization == 0.9 and config.cpu_bind == "auto"


def test_the_settings_are_not_listed_again():
    """create_engine_config and LLM take EngineArgs' names, without a list of
    their own: an unknown name is refused before anything loads."""
    assert list(inspect.signature(create_engine_config).parameters) == ["model", "usage_context", "settings"]
    assert list(inspect.signature(raylm.LLM).parameters) == ["model", "engine_args"]
    with pytest.raises(TypeError, match="no_such_setting"):
        create_engine_config(no_such_setting=1)
    with pytest.raises(TypeError, match="no_such_setting"):
        raylm.LLM(no_such_setting=1)


def test_cli_modules_do_not_import_each_other():
    """cli.py registers the server's commands (openai/cli_args.py); the shared
    pieces both need (HelpFormatter, parsers, EngineArgs) come from below."""
    path = Path(raylm.__file__).parent / "entrypoints" / "openai" / "cli_args.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert "raylm.entrypoints.cli" not in imported
