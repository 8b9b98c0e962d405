"""What raylm puts in the runtime_env of the Ray actors it starts (ranks,
data-parallel replicas): Ray keeps it with the actor and its state API shows
it to anyone who reaches the dashboard, so no key or token may go there,
whatever its name; the settings actors read still do. No Ray is started."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from raylm.executor.ray_placement import (
    FORWARDED_ENV_VARS,
    NEVER_FORWARDED_ENV_VARS,
    rank_actor_options,
    worker_env_vars,
)

RAYLM_SOURCE = Path(__file__).resolve().parents[2] / "raylm"
SECRETS = {
    "RAYLM_API_KEY": "sk-server-key",
    "VLLM_API_KEY": "sk-vllm-key",
    "RAYLM_MY_TOKEN": "a-token-of-the-users-own",
    "RAYLM_DB_PASSWORD": "hunter2",
    "HF_TOKEN": "hf_secret",
}
SETTINGS = {"RAYLM_FAULT_INJECTION": "slow:token=3:ms=1", "RAYLM_MQ_UNAUTHENTICATED_TCP": "1", "HF_HOME": "/hf"}


@pytest.fixture
def driver_env(monkeypatch):
    for name, value in {**SECRETS, **SETTINGS}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_no_secret_reaches_an_actors_runtime_env(driver_env, device):
    env = worker_env_vars(device)
    assert not set(SECRETS) & set(env), env
    assert not any(value in env.values() for value in SECRETS.values())
    # What the actors read still reaches them; a per-worker variable never does.
    assert {k: env[k] for k in SETTINGS} == SETTINGS
    assert "CUDA_VISIBLE_DEVICES" not in env and "RAYLM_DRIVER_NICENESS" in env


def test_a_ranks_actor_options_carry_no_secret(driver_env):
    options = rank_actor_options(None, 0, "cpu", cpus_per_worker=2)
    env = options["runtime_env"]["env_vars"]
    assert not set(SECRETS) & set(env) and env["OMP_NUM_THREADS"] == "2"


def test_every_raylm_variable_raylm_reads_is_forwarded_or_kept_on_the_driver():
    # An allow list drops a variable nobody listed: a new RAYLM_* setting an
    # actor reads must be added to FORWARDED_ENV_VARS (or, a secret, to
    # NEVER_FORWARDED_ENV_VARS), not silently go missing in the actors.
    named = set()
    for path in RAYLM_SOURCE.rglob("*.py"):
        named |= set(re.findall(r"[\"'](RAYLM_[A-Z0-9_]+)[\"']", path.read_text()))
    assert "RAYLM_API_KEY" in named and "RAYLM_FAULT_INJECTION" in named
    assert named - set(FORWARDED_ENV_VARS) - set(NEVER_FORWARDED_ENV_VARS) == set()
    assert not set(FORWARDED_ENV_VARS) & set(NEVER_FORWARDED_ENV_VARS)
