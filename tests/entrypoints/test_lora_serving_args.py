"""`raylm serve`'s LoRA flags, refused before the model loads when they
cannot work or would open the run-time routes to anyone; --lora-modules in
vLLM's two forms; a bad adapter among them stops the start, named; paths of
run-time loads confined to --lora-directory (symlinks followed)."""

from __future__ import annotations

import argparse
import asyncio
import os
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from raylm.config import create_engine_config
from raylm.engine.input_processor import InputProcessor
from raylm.engine.protocol import SchedulerStats
from raylm.entrypoints.cli import build_parser
from raylm.entrypoints.openai.api_server import served_adapters_from
from raylm.entrypoints.openai.cli_args import check_lora_serving_args
from raylm.entrypoints.openai.metrics import PrometheusStatLogger
from raylm.entrypoints.openai.serving_common import OpenAIError
from raylm.entrypoints.openai.serving_lora import LoRAModule, ServedAdapters, confined_path, parse_lora_module
from raylm.testing.lora_oracle import make_tiny_adapter


def _serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "m", *flags])


def test_lora_modules_take_vllms_two_forms():
    args = _serve_args(
        "--enable-lora", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b", "base_model_name": "m"}'
    )
    assert args.lora_modules == [LoRAModule("a", "/x/a"), LoRAModule("b", "/x/b", "m")]
    for bad in ("no-equals", "=/path", "name=", '{"name": "a"}', '{"name": "a", "path": "/p", "x": 1}', "{nope"):
        with pytest.raises(argparse.ArgumentTypeError, match="--lora-modules"):
            parse_lora_module(bad)


RUNTIME = ["--enable-lora", "--allow-runtime-lora-updating", "--lora-directory", "DIR"]
VLLM_SWITCH = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}


@pytest.mark.parametrize(
    "flags, env, words",
    [
        (["--lora-modules", "a=/x"], {}, "need --enable-lora"),
        (["--allow-runtime-lora-updating"], {}, "need --enable-lora"),
        (["--enable-lora", "--allow-runtime-lora-updating"], {}, "needs --lora-directory"),
        ([*RUNTIME, "--host", "0.0.0.0"], {}, "needs --api-key"),
        # vLLM's switch turns the routes on as the flag does, with the same guard.
        (["--enable-lora", "--lora-directory", "DIR", "--host", "10.1.2.3"], VLLM_SWITCH, "needs --api-key"),
        (["--enable-lora", "--max-served-loras", "0"], {}, "--max-served-loras"),
        (["--enable-lora", "--max-served-loras", "1", "--lora-modules", "a=/x", "b=/y"], {}, "over --max-served-loras"),
    ],
)  # fmt: skip
def test_unworkable_or_open_lora_flags_are_refused_before_the_model_loads(flags, env, words, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = _serve_args(*[str(tmp_path) if f == "DIR" else f for f in flags])
    with pytest.raises(ValueError, match=words):
        check_lora_serving_args(args)


def test_runtime_updating_on_a_loopback_bind_or_with_a_key_is_accepted(tmp_path):
    for flags in (["--host", "127.0.0.1"], ["--host", "0.0.0.0", "--api-key", "k"]):
        args = _serve_args("--enable-lora", "--allow-runtime-lora-updating", "--lora-directory", str(tmp_path), *flags)
        check_lora_serving_args(args)
        assert args.allow_runtime_lora_updating


def test_runtime_paths_stay_inside_the_lora_directory(tmp_path):
    root, outside = tmp_path / "loras", tmp_path / "elsewhere"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, root / "link")
    assert confined_path(str(root), "a") == os.path.realpath(root / "a")
    assert confined_path(str(root), str(root / "a")) == os.path.realpath(root / "a")
    for path in ("link", "../elsewhere", str(outside), "a/../../elsewhere"):
        with pytest.raises(ValueError, match="outside the server's --lora-directory"):
            confined_path(str(root), path)


def test_a_bad_startup_adapter_stops_the_start_naming_it(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    good = make_tiny_adapter(model, tmp_path / "good", seed=1, rank=4)
    too_big = make_tiny_adapter(model, tmp_path / "big", seed=2, rank=16)
    config = create_engine_config(model, dtype="float32", enable_lora=True, max_lora_rank=8)
    engine = SimpleNamespace(
        config=config,
        input_processor=InputProcessor(config.model_config, AutoTokenizer.from_pretrained(model), config.lora_config),
    )
    stat_logger = PrometheusStatLogger("m")
    args = _serve_args("--enable-lora", "--lora-modules", f"good={good}")
    adapters = served_adapters_from(args, engine, ["m"], stat_logger)
    assert adapters.names() == ["good"] and not adapters.runtime_updating
    assert adapters.resolve("good")[1].lora_path == good
    assert stat_logger.lora_load_time._sum.get() > 0  # the load was timed
    args = _serve_args("--enable-lora", "--lora-modules", f"good={good}", f"big={too_big}")
    with pytest.raises(ValueError, match=r"--lora-modules big=.*r 16 is over max_lora_rank \(8\)"):
        served_adapters_from(args, engine, ["m"], stat_logger)


def test_lora_requests_info_keeps_the_present_series_only():
    """vLLM's labels; clients choose which adapters run, so the gauge keeps
    one series (the last report's), not one per set ever seen."""
    stat_logger = PrometheusStatLogger("m")
    stat_logger.record_scheduler_stats(SchedulerStats(lora_running=["a"]))
    assert "vllm:lora_requests_info{" not in stat_logger.render().decode()  # LoRA off: nothing
    stat_logger.max_loras = 2
    for running, waiting in ((["a"], []), (["a", "b"], ["c"]), (["b"], ["c", "d"])):
        stat_logger.record_scheduler_stats(SchedulerStats(lora_running=running, lora_waiting=waiting))
    lines = stat_logger.render().decode().splitlines()
    series = [line for line in lines if line.startswith("vllm:lora_requests_info{")]
    assert len(series) == 1
    assert 'running_lora_adapters="b"' in series[0] and 'waiting_lora_adapters="c,d"' in series[0]
    assert 'max_lora="2"' in series[0]


def test_an_unload_waits_for_a_request_still_on_its_way_to_the_engine(tmp_path):
    """A handler that looked the adapter up holds it until it returns (by
    then its request is in the engine, which the unload waits for too)."""
    engine = SimpleNamespace(
        input_processor=SimpleNamespace(check_lora_request=lambda request: request),
        num_requests_with_adapter=lambda lora_int_id: 0,
    )

    async def go() -> None:
        adapters = ServedAdapters(engine, ["m"], lora_directory=str(tmp_path))
        adapters.add("a", str(tmp_path))
        with adapters.holding("a"):
            assert adapters.resolve("a")[1] is not None
            unload = asyncio.ensure_future(adapters.unload("a"))
            for _ in range(5):
                await asyncio.sleep(0.02)
            assert not unload.done(), "the unload answered while a request held the adapter"
            with pytest.raises(OpenAIError, match="does not exist"):
                adapters.resolve("a")  # the name left at once
        await asyncio.wait_for(unload, 10)
        with adapters.holding("m"), adapters.holding(None):
            pass  # the base model's names hold nothing

    asyncio.run(go())
