"""EngineArgs where programs written against vLLM look for it
(`from vllm.engine.arg_utils import EngineArgs`), and the command line's
shared pieces: the help formatter and the flags' value parsers.

The settings themselves are declared once, on EngineArgs in
raylm/config/engine_args.py (each with its flag, help and parser); the
`raylm` commands build their engine flags with `EngineArgs.add_cli_args` and
read them with `EngineArgs.from_cli_args`. Living here rather than in
entrypoints/cli.py, these pieces let the commands' modules (cli, openai/
cli_args, plan) each import them without importing one another.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from raylm.config.engine_args import (
    EXECUTOR_BACKENDS,
    PLACEMENT_STRATEGIES,
    EngineArgs,
    Flag,
    create_engine_config,
    human_readable_int,
    max_model_len_arg,
    parse_bytes,
)

__all__ = [
    "EXECUTOR_BACKENDS",
    "PLACEMENT_STRATEGIES",
    "AsyncEngineArgs",
    "EngineArgs",
    "Flag",
    "HelpFormatter",
    "create_engine_config",
    "human_readable_int",
    "max_model_len_arg",
    "parse_bytes",
]


@dataclass
class AsyncEngineArgs(EngineArgs):
    """The same settings for the serving engine (AsyncLLM.from_engine_args)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only when there is one worth showing (not for
    switches, nor for an unset default, which the help text explains)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool) or action.default == argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)
