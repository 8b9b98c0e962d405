"""Run docs/kuberay/serve_config.yaml with `serve run`, on this machine, as
the RayService would run it on a cluster (issue 52: the operator's guide's
commands run as written), and check that it answers.

    pip install -e ".[serve]"   # the `serve` command needs Serve's extra (watchfiles)
    python scripts/serve_run_config.py [--timeout 600]

The config names a Hub model with TP=2 and 4 threads a replica, sized for
a cluster; this machine has no Hub access and may have 2 cores. So the run
keeps every other field and changes only these, in a copy: the model (the
embedded default), tensor_parallel_size 1, num_threads 1, a small KV cache
and context, autoscaling pinned to one replica, and the HTTP bind
(127.0.0.1 on a free port). Then: `serve run` on the copy, in a Ray of its
own (a temporary folder); /v1/models lists the served name; a greedy
completion equals the same prompt through `raylm.LLM`; SIGINT stops it and
no process of its tree is left. Exit 0 when all of that holds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "docs" / "kuberay" / "serve_config.yaml"
PROMPT = "ROMEO: speak"
MAX_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_config(port: int) -> dict:
    """The documented config, with only what this machine cannot run changed."""
    config = yaml.safe_load(CONFIG.read_text())
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": port}
    [application] = config["applications"]
    args = application["args"]
    args.pop("model")  # the embedded default model
    args.update(
        tensor_parallel_size=1,
        num_threads=1,
        max_model_len=512,
        kv_cache_memory_bytes="64MiB",
        ray_placement_strategy="PACK",
    )
    args["autoscaling_config"] = {**args["autoscaling_config"], "min_replicas": 1, "max_replicas": 1}
    return config


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_for_models(base: str, process: subprocess.Popen, deadline: float) -> dict:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve run exited with {process.returncode} before it served")
        try:
            return _get(base + "/v1/models")
        except OSError:
            time.sleep(2)
    raise TimeoutError("serve run did not serve /v1/models in time")


def _offline_text() -> str:
    from raylm import LLM, SamplingParams

    with LLM(None, num_threads=1, max_model_len=512, kv_cache_memory_bytes=64 << 20) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for serve run to answer")
    args = parser.parse_args()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="raylm-serve-run-") as tmp:
        path = pathlib.Path(tmp) / "serve_config.yaml"
        config = local_config(port)
        path.write_text(yaml.safe_dump(config))
        served = config["applications"][0]["args"]["served_model_name"]
        env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_ADDRESS": "local"}
        started = time.monotonic()
        log = open(pathlib.Path(tmp) / "serve.log", "w")
        process = subprocess.Popen(
            ["serve", "run", str(path)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        tree: set[int] = set()
        try:
            models = _wait_for_models(base, process, started + args.timeout)
            print(f"serve run answered after {time.monotonic() - started:.0f} s: {[m['id'] for m in models['data']]}")
            assert served in [m["id"] for m in models["data"]], models
            tree = {p.pid for p in psutil.Process(process.pid).children(recursive=True)} | {process.pid}
            answer = _post(
                base + "/v1/completions",
                {"model": served, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
            )
            text = answer["choices"][0]["text"]
            expected = _offline_text()
            print(f"completion {text!r}; raylm.LLM {expected!r}")
            assert text == expected, "the Serve application's greedy text differs from raylm.LLM's"
        except BaseException:
            log.flush()
            print((pathlib.Path(tmp) / "serve.log").read_text()[-6000:], file=sys.stderr)
            raise
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)  # as Ctrl-C: serve run shuts the application and Ray down
                try:
                    process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            log.close()
        time.sleep(5)  # Ray's daemons leave after the driver
        left = [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        assert not left, f"processes of serve run left behind: {left}"
    print("ok: serve run of docs/kuberay/serve_config.yaml served, answered as raylm.LLM does, and stopped clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
