"""raylm's import asks torch's OpenMP runtime for a short idle spin (see
raylm/openmp_env.py), only when it can still take effect and the user has not
chosen one. Each case runs in a fresh interpreter: the setting is read once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPORT = ("import json, os; from raylm.openmp_env import spin_is_limited; "
          "print(json.dumps([spin_is_limited(), os.environ.get('GOMP_SPINCOUNT'), os.environ.get('KMP_BLOCKTIME')]))")


def _run(code: str, **env) -> list:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code + "; " + REPORT], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_raylm_first_limits_the_spin_before_torch_loads():
    assert _run("import raylm, torch") == [True, "1000", "1"]


def test_torch_first_is_left_alone_and_says_so():
    # The runtime has read its settings; setting them now would only mislead child processes.
    assert _run("import torch, raylm") == [False, None, None]


@pytest.mark.parametrize("env,limited", [({"GOMP_SPINCOUNT": "300000"}, False), ({"OMP_WAIT_POLICY": "PASSIVE"}, True)])
def test_a_users_choice_is_kept(env, limited):
    got = _run("import raylm", **env)
    assert got[0] is limited
    assert got[1] == env.get("GOMP_SPINCOUNT") and got[2] is None
