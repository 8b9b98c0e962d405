"""--engine-start-timeout reaches the engine config (FaultToleranceConfig.
engine_start_timeout_s) from every command and from EngineArgs, like
--execute-model-timeout."""

from __future__ import annotations

import pytest

from raylm.config import FaultToleranceConfig, create_engine_config
from raylm.engine.arg_utils import AsyncEngineArgs
from raylm.entrypoints.cli import build_parser


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_the_flag_becomes_the_engine_kwarg(command):
    args = build_parser().parse_args(command + ["--model", "/m", "--engine-start-timeout", "42.5"])
    assert AsyncEngineArgs.from_cli_args(args).engine_start_timeout == 42.5
    default = build_parser().parse_args(command + ["--model", "/m"])
    assert AsyncEngineArgs.from_cli_args(default).engine_start_timeout == FaultToleranceConfig().engine_start_timeout_s


def test_the_config_takes_it_and_refuses_nonsense(tiny_model_dir):
    model = tiny_model_dir("llama")
    assert create_engine_config(model).fault_tolerance.engine_start_timeout_s == 600.0
    assert create_engine_config(model, engine_start_timeout=5).fault_tolerance.engine_start_timeout_s == 5.0
    with pytest.raises(ValueError, match="engine_start_timeout"):
        create_engine_config(model, engine_start_timeout=0)
