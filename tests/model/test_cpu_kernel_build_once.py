"""The CPU kernels are built once per machine and environment, however the
engine starts: the CLI, `LLM()`, mp workers, Ray actors and data-parallel
replicas (mp and Ray) all load one build folder, and none of them runs the
compiler again. (Before, processes started different ways could load one folder
with different command lines, and ninja rebuilt it each time the other kind came.)

The engines run in child processes with their own TORCH_EXTENSIONS_DIR and HOME
(so a process that ignored TORCH_EXTENSIONS_DIR would build under that HOME, in
sight of the test). The folder is seeded with this process's finished build
(built here first if this environment has none yet), so the test compiles
nothing it would not compile anyway."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

import raylm.model.layers.cpu_kernels as ck
from raylm.executor.ray_placement import worker_env_vars
from raylm.testing import make_tiny_model
from tests.conftest import wait_until

# Starts its own local Ray in a child process (not the session's: that one's
# actors have this process's HOME), mp workers and replicas: 3.5 min on a busy
# 2-core machine, more when this environment's kernels are built here first.
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1200)]

ENGINES = r"""
import json, sys
from raylm import LLM, SamplingParams
import raylm.model.layers.cpu_kernels as ck


def kernel_file(worker=None):
    import raylm.model.layers.cpu_kernels as ck
    module = ck.get_cpu_kernels()
    return None if module is None else module.__file__


ways = {
    "LLM()": {},
    "mp TP=2": dict(tensor_parallel_size=2, distributed_executor_backend="mp"),
    "Ray TP=2": dict(tensor_parallel_size=2, distributed_executor_backend="ray"),
    "DP=2 mp": dict(data_parallel_size=2, data_parallel_backend="mp"),
    "DP=2 Ray": dict(data_parallel_size=2, data_parallel_backend="ray"),
}
files = {}
params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
for way, kwargs in ways.items():
    with LLM(sys.argv[1], dtype="float32", num_threads=1, kv_cache_memory_bytes=16 << 20, **kwargs) as llm:
        [out] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 2, way
        if "data_parallel_size" not in kwargs:  # replicas hold their executors in other processes
            executor = llm.llm_engine.engine_core.engine_core.executor
            files[way] = executor.collective_rpc(kernel_file)
files["driver"] = [kernel_file()]
print("KERNEL_FILES " + json.dumps(files), flush=True)
"""


def _ninja_log(folder: Path) -> list[str]:
    log = folder / ".ninja_log"
    return log.read_text().splitlines() if log.exists() else []


def _ours(tag: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("RAYLM_TEST_BUILD_ONCE") == tag:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def test_ray_actors_get_the_drivers_kernel_settings(monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/some/where")
    monkeypatch.setenv("CXX", "g++")
    env = worker_env_vars("cpu")
    assert env["TORCH_EXTENSIONS_DIR"] == "/some/where" and env["CXX"] == "g++"


def test_every_way_of_starting_loads_one_build(tmp_path):
    module = ck.get_cpu_kernels()
    if module is None:
        pytest.skip("the CPU kernels do not build in this environment")
    built = Path(module.__file__).parent
    assert (built / ck._BUILT_NAME).exists(), "this process's build is marked finished"
    root, home = tmp_path / "extensions", tmp_path / "home"
    home.mkdir()
    seeded = root / built.name
    shutil.copytree(built, seeded, ignore=shutil.ignore_patterns(ck._LOCK_NAME, "lock"))
    log_before = _ninja_log(seeded)
    model = make_tiny_model("llama", tmp_path / "model", seed=0)

    tag = uuid.uuid4().hex
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root), HOME=str(home), RAYLM_TEST_BUILD_ONCE=tag)
    env.pop(ck.DISABLE_ENV, None)
    runs = {
        "CLI": [
            sys.executable,
            "-m",
            "raylm.entrypoints.cli",
            "generate",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--max-tokens",
            "2",
            "--num-threads",
            "1",
            "--kv-cache-memory-bytes",
            "16MiB",
            "Hi",
        ],
        "engines": [sys.executable, "-c", ENGINES, str(model)],
    }
    outputs = {}
    try:
        for name, command in runs.items():
            proc = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=480)
            assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
            assert "CPU kernels unavailable" not in proc.stderr, f"{name}: {proc.stderr[-3000:]}"
            outputs[name] = proc.stdout
    finally:
        # Ray's daemons, the workers and the replicas end with the children.
        try:
            wait_until(
                lambda: not _ours(tag), 60, step=0.5, message=lambda: f"the children's processes to end: {_ours(tag)}"
            )
        finally:
            for process in _ours(tag):
                process.kill()

    [line] = [x for x in outputs["engines"].splitlines() if x.startswith("KERNEL_FILES ")]
    files = json.loads(line.removeprefix("KERNEL_FILES "))
    so = str(seeded / f"{built.name}.so")
    assert files == {"LLM()": [so], "mp TP=2": [so, so], "Ray TP=2": [so, so], "driver": [so]}
    assert [p.name for p in root.iterdir()] == [built.name], "one build folder for every way"
    assert not (home / ".cache" / "raylm" / "torch_extensions").exists(), "no process built elsewhere"
    assert _ninja_log(seeded) == log_before, "nothing was compiled again"
