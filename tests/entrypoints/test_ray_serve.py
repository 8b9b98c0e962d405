"""raylm as a Ray Serve application (raylm/ray_serve.py), in the session's
local Ray: Serve's proxy on a free port, queried with the `openai` client.

- the embedded default model: completions, chat and streaming give the
  offline engine's greedy text; a client that leaves a stream makes Serve
  cancel it, and the engine ends it as aborted (not run to max_tokens);
- a replica with TP=2: its ranks are Ray actors in the replica's own
  placement group (bundles 1 and 2 of it), same greedy text as offline;
- a replica whose engine died for good fails Serve's health check and is
  replaced by one that serves;
- Serve's autoscaling adds a replica (an engine) under concurrent streams
  and removes it when idle, every stream complete;
- deleting an application leaves no replica, rank actor or placement group;
- build_pd_openai_app: one Serve replica whose engine runs the prefill and
  the decode config's replicas as its two roles (each with its own threads),
  the offline engine's greedy text, a hand-off counted, nothing left after.
"""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from raylm import LLM, SamplingParams
from raylm.ray_serve import MIN_SERVE_RAY_VERSION, build_openai_app, build_pd_openai_app
from tests.conftest import start_shared_ray, wait_until
from tests.entrypoints.openai.server_utils import free_port

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(
        tuple(int(p) for p in __import__("ray").__version__.split(".")[:2]) < MIN_SERVE_RAY_VERSION,
        reason="raylm.ray_serve supports Ray >= 2.58 (README, Supported versions)",
    ),
]

# One torch thread and a small KV cache keep the shared two-core machine usable.
ENGINE = {"num_threads": 1, "kv_cache_memory_bytes": 4 << 20, "max_model_len": 512}
PROMPT = "ROMEO:"
MESSAGES = [{"role": "user", "content": "Speak, friend."}]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def serve_port():
    """Serve's HTTP proxy on a free port of the session's Ray, started once for
    the module's tests (each deletes its application and checks nothing of it
    is left); shut down after them (its controller and proxy actors go)."""
    from ray import serve

    start_shared_ray()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        # Gone before anything later starts Serve again (it would join this one).
        wait_until(
            lambda: not _live_actors("ServeController") and not _live_actors("ProxyActor"),
            60,
            message="Serve's controller and proxy to be gone",
        )


@pytest.fixture
def serve_url(ray_session, serve_port):
    return f"http://127.0.0.1:{serve_port}"


def _live_actors(class_part: str) -> list[dict]:
    from ray._private.state import actors

    return [a for a in actors().values() if class_part in a["ActorClassName"] and a["State"] != "DEAD"]


def _live_placement_groups() -> list[dict]:
    from ray.util import placement_group_table

    return [g for g in placement_group_table().values() if g["state"] != "REMOVED"]


def _delete_and_check_gone(name: str) -> None:
    """serve.delete, then nothing of the application is left in Ray."""
    from ray import serve

    serve.delete(name)
    wait_until(
        lambda: (
            not _live_actors("ServeReplica")
            and not _live_actors("RayWorkerWrapper")
            and not _live_actors("EngineCoreActor")
            and not _live_placement_groups()
        ),
        60,
        message=lambda: (
            f"replicas {len(_live_actors('ServeReplica'))}, ranks {len(_live_actors('RayWorkerWrapper'))}, "
            f"engine cores {len(_live_actors('EngineCoreActor'))}, groups {_live_placement_groups()}"
        ),
    )


def _aborted_requests(metrics_text: str) -> float:
    match = re.search(
        r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', metrics_text, re.MULTILINE
    )
    return float(match.group(1)) if match else 0.0


def test_default_model_app_serves_completions_chat_and_streams(serve_url):
    from ray import serve

    serve.run(build_openai_app(ENGINE), name="raylm-default-app", route_prefix="/")
    try:
        client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        assert model == "raylm-default"

        completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
        chat_stream = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
        )
        chat_streamed = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
        with LLM(**ENGINE) as llm:
            expected = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text
            expected_chat = llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0].outputs[0].text
        assert completion.choices[0].text == streamed == expected
        assert chat.choices[0].message.content == chat_streamed == expected_chat
        # Bad input is the server's 400 with an OpenAI error body, through Serve too.
        bad = httpx.post(f"{serve_url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        assert httpx.get(f"{serve_url}/health").status_code == 200

        # A client that stops reading a long stream: Serve cancels the request,
        # and the engine ends it as aborted instead of running it to max_tokens.
        handle = serve.get_app_handle("raylm-default-app")
        before = _aborted_requests(httpx.get(f"{serve_url}/metrics").text)
        with httpx.stream(
            "POST",
            f"{serve_url}/v1/completions",
            timeout=60,
            json={"model": model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True},
        ) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        wait_until(
            lambda: _aborted_requests(httpx.get(f"{serve_url}/metrics").text) == before + 1,
            60,
            message="the left stream to end as aborted",
        )
        assert handle.num_unfinished_requests.remote().result() == 0
    finally:
        _delete_and_check_gone("raylm-default-app")


def _handoffs_ok(metrics_text: str) -> float:
    match = re.search(r'^raylm:pd_handoffs_total\{[^}]*outcome="ok"[^}]*\} (\S+)$', metrics_text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_pd_app_serves_with_a_prefill_and_a_decode_role(serve_url):
    """Ray Serve LLM's shape, one raylm engine under it: the prefill config's
    replica prefills (with its own 2 threads per worker), the decode
    config's decodes, the request handed off between them; the same text as
    the offline engine's."""
    from ray import serve

    engine = dict(ENGINE, pd_min_prompt_tokens=0)  # (a short prompt is handed off too)
    app = build_pd_openai_app(
        {
            "prefill_config": {"engine_kwargs": dict(engine, num_threads=2)},
            "decode_config": {"engine_kwargs": engine},
            "ingress_deployment_config": {"name": "raylm-pd-test"},
        }
    )
    serve.run(app, name="raylm-pd-app", route_prefix="/")
    try:
        client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        health = httpx.get(f"{serve_url}/health")
        assert health.status_code == 200
        replicas = [(r["role"], r["state"], r["threads"]) for r in health.json()["replicas"]]
        assert replicas == [("prefill", "serving", 2), ("decode", "serving", 1)]
        assert _handoffs_ok(httpx.get(f"{serve_url}/metrics").text) >= 1
        with LLM(**ENGINE) as llm:
            expected = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text
        assert completion.choices[0].text == expected
    finally:
        _delete_and_check_gone("raylm-pd-app")


def test_tp2_replica_places_its_ranks_in_its_own_placement_group(serve_url, tiny_model_dir):
    from ray import serve

    llama = tiny_model_dir("llama")
    app = build_openai_app(
        {"model": llama, "tensor_parallel_size": 2, "served_model_name": "tiny", **ENGINE},
        deployment_config={"name": "raylm-tp2"},
    )
    serve.run(app, name="raylm-tp2-app", route_prefix="/")
    try:
        client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0)
        ranks = _live_actors("RayWorkerWrapper")
        replicas = _live_actors("ServeReplica")
        assert len(ranks) == 2 and len(replicas) == 1
        # The ranks live in the replica's group, the only one: the one Serve
        # made with a bundle for the replica and one per rank (raylm's own
        # would ask for a sliver of the driver's node in its first bundle).
        (group,) = _live_placement_groups()
        assert [b for b in group["bundles"].values()] == [{"CPU": 0.01}, {"CPU": 1.0}, {"CPU": 1.0}]
        with LLM(llama, max_model_len=512, kv_cache_memory_bytes=4 << 20) as llm:
            expected = llm.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0].text
        assert completion.choices[0].text == expected
    finally:
        _delete_and_check_gone("raylm-tp2-app")


def test_serve_replaces_a_replica_whose_engine_died(serve_url):
    """Serve's health check asks the engine: a replica whose engine core died
    for good (no restart allowed) fails it, and Serve starts a new replica."""
    import psutil
    from ray import serve

    app = build_openai_app(
        {**ENGINE, "max_restarts": 0}, deployment_config={"health_check_period_s": 1, "health_check_timeout_s": 10}
    )
    serve.run(app, name="raylm-health-app", route_prefix="/")
    try:
        client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model="raylm-default", prompt=PROMPT, max_tokens=2).choices[0].text
        (replica,) = _live_actors("ServeReplica")
        for child in psutil.Process(replica["Pid"]).children(recursive=True):
            child.kill()  # the engine core process: with max_restarts 0 the engine is dead for good

        def replaced_and_serving() -> bool:
            live = _live_actors("ServeReplica")
            if len(live) != 1 or live[0]["Pid"] == replica["Pid"]:
                return False
            try:
                return bool(client.completions.create(model="raylm-default", prompt=PROMPT, max_tokens=2))
            except openai.APIError:
                return False

        wait_until(replaced_and_serving, 300, step=1.0, message="a new replica to serve")
    finally:
        _delete_and_check_gone("raylm-health-app")


def test_serve_autoscaling_adds_a_replica_under_load_and_removes_it_when_idle(serve_url):
    """Serve's autoscaling drives raylm replicas: with a target of one ongoing
    request per replica, four concurrent streams bring up a second replica
    (an engine of its own), every stream completes in full, and once idle the
    deployment returns to one replica."""
    import concurrent.futures

    from ray import serve

    max_tokens = 200
    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 1,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 1.0,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 2.0,
    }
    app = build_openai_app(ENGINE, deployment_config={"autoscaling_config": autoscaling})
    serve.run(app, name="raylm-autoscale-app", route_prefix="/")
    try:
        client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=600)
        assert len(_live_actors("ServeReplica")) == 1

        def stream(seed: int) -> tuple[str | None, int | None]:
            """(finish reason, completion tokens) of one long stream. Long enough for
            Serve's controller to see the load (not a timing bound: the loop below
            keeps sending streams until the second replica is up)."""
            finish, tokens = None, None
            chunks = client.completions.create(
                model="raylm-default",
                prompt=PROMPT,
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "seed": seed},
            )
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return finish, tokens

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            seed = 0
            while True:
                futures = [pool.submit(stream, seed + i) for i in range(4)]
                seed += 4
                scaled = False
                for future in futures:
                    while not future.done():
                        scaled = scaled or len(_live_actors("ServeReplica")) == 2
                        try:
                            future.result(timeout=0.5)
                        except concurrent.futures.TimeoutError:
                            pass
                    assert future.result() == ("length", max_tokens)  # every stream complete, none errored
                if scaled or len(_live_actors("ServeReplica")) == 2:
                    break
                assert seed < 40, "Serve never added a replica under four concurrent streams"
        wait_until(
            lambda: len(_live_actors("ServeReplica")) == 1,
            180,
            step=1.0,
            message="the idle deployment to return to one replica",
        )
        # The remaining replica still serves.
        assert client.completions.create(model="raylm-default", prompt=PROMPT, max_tokens=2).choices[0].text
    finally:
        _delete_and_check_gone("raylm-autoscale-app")
