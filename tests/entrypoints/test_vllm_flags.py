"""A vLLM user changes one word: vLLM's launch flags start `raylm serve`
unchanged (one HTTPS server, started once), generation_config.json supplies
request defaults and stop tokens, and the flag parsers follow vLLM's."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.config import create_engine_config
from raylm.engine.arg_utils import EngineArgs, human_readable_int
from raylm.engine.tokenizer import encode_rendered_chat, load_tokenizer
from raylm.entrypoints.cli import build_parser
from raylm.entrypoints.openai.cli_args import json_list, resolve_api_key
from tests.entrypoints.openai.server_utils import MODEL_NAME, RaylmServer

API_KEY = "key-from-vllm-env"
ORIGIN = "https://app.example"
# Sampling defaults written into a generation_config.json for the server.
GENERATION_DEFAULTS = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
CONVERSATION = [{"role": "user", "content": "Hello there"}]


# ---------------------------------------------------------------- flag parsing


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4096", 4096),
        ("4k", 4000),
        ("25.6k", 25600),
        ("32K", 32768),
        ("1m", 1_000_000),
        ("2M", 2 * 2**20),
    ],
)
def test_max_model_len_suffixes_follow_vllm(text, expected):
    assert human_readable_int(text) == expected
    args = build_parser().parse_args(["generate", "x", "--max-model-len", text])
    assert args.max_model_len == expected


@pytest.mark.parametrize("text", ["1.5K", "4kb", "k", "-3", "4 096"])
def test_bad_max_model_len_is_refused(text, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--max-model-len", text])
    assert "--max-model-len" in capsys.readouterr().err


def test_max_model_len_auto_means_the_models():
    assert build_parser().parse_args(["generate", "x", "--max-model-len", "auto"]).max_model_len is None


def test_json_list_flags():
    assert json_list('["https://a.example", "https://b.example"]') == ["https://a.example", "https://b.example"]
    assert json_list("GET,POST") == ["GET", "POST"]
    with pytest.raises(argparse.ArgumentTypeError):
        json_list('{"not": "a list"}')


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.delenv("RAYLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert resolve_api_key(None) == "from-vllm"
    monkeypatch.setenv("RAYLM_API_KEY", "from-raylm")
    assert resolve_api_key(None) == "from-raylm"
    assert resolve_api_key("from-flag") == "from-flag"


def test_quantization_other_than_none_is_refused_naming_what_loads(tiny_model_dir):
    # int8 and gguf are raylm's own methods (tests/model/test_int8.py, test_gguf.py); vLLM's others are refused.
    assert create_engine_config(model=tiny_model_dir("llama"), quantization=None).model_config.model
    with pytest.raises(ValueError, match=r"quantization 'awq' is not supported; supported: int8 .*gguf .*unquantized"):
        create_engine_config(model=tiny_model_dir("llama"), quantization="awq")
    result = subprocess.run(
        [sys.executable, "-m", "raylm.entrypoints.cli", "generate", "x", "-q", "gptq"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: quantization 'gptq' is not supported")


@pytest.mark.parametrize("value", [0, 1.5, -0.1])
def test_gpu_memory_utilization_must_be_a_fraction(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        create_engine_config(gpu_memory_utilization=value, device="cpu")


def test_engine_args_from_cli_flags_build_the_same_config(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = build_parser().parse_args(
        [
            "generate",
            "x",
            "--model",
            model,
            "--max-model-len",
            "0.3k",
            "--no-enable-prefix-caching",
            "--block-size",
            "32",
            "--generation-config",
            "vllm",
            "--chat-template",
            str(template),
            "--kv-cache-memory-bytes",
            "4MiB",
            "--device",
            "cpu",
            "--max-num-seqs",
            "4",
        ]
    )
    from_engine_args = EngineArgs.from_cli_args(args).create_engine_config()
    from_cli = create_engine_config(**EngineArgs.from_cli_args(args).to_kwargs())
    for config in (from_engine_args, from_cli):
        assert config.model_config.max_model_len == 300
        assert config.cache_config.enable_prefix_caching is False
        assert config.cache_config.block_size == 32
        assert config.scheduler_config.max_num_seqs == 4
        assert config.model_config.default_sampling_params == {}
        assert config.model_config.chat_template == CHAT_TEMPLATE
    assert build_parser().parse_args(["generate", "x", "--enable-prefix-caching"]).enable_prefix_caching is True


# ---------------------------------------------------------- generation_config


def _model_with_generation_config(source: str, folder, generation_config: dict) -> str:
    shutil.copytree(source, folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(generation_config, f)
    return str(folder)


def test_generation_config_auto_sets_defaults_and_stop_tokens(tiny_model_dir, tmp_path):
    """auto: the file's sampling settings are the default SamplingParams, and
    the end-of-sequence ids it lists beyond the tokenizer's stop generation
    (here: the third token greedy decoding produces)."""
    source = tiny_model_dir("llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(model=source, num_threads=1, kv_cache_memory_bytes=4 << 20) as llm:
        tokens = llm.generate("Hello there", greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    with open(os.path.join(source, "config.json")) as f:
        model_eos = json.load(f)["eos_token_id"]
    folder = _model_with_generation_config(
        source, tmp_path / "model", {**GENERATION_DEFAULTS, "eos_token_id": [model_eos, tokens[stop_at]]}
    )

    inline_template = CHAT_TEMPLATE.replace("\n", "\\n")  # as typed on a command line
    with LLM(model=folder, num_threads=1, kv_cache_memory_bytes=4 << 20, chat_template=inline_template) as llm:
        defaults = llm.get_default_sampling_params()
        assert {k: getattr(defaults, k) for k in GENERATION_DEFAULTS} == GENERATION_DEFAULTS
        stopped = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[
            0
        ].outputs[0]
        assert stopped.finish_reason == "stop"
        assert list(stopped.token_ids) == list(tokens[: stop_at + 1])
        # --chat-template (inline, escapes decoded) replaces the tokenizer's for LLM.chat.
        oracle = load_tokenizer(source).apply_chat_template(
            CONVERSATION, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
        )
        assert llm.apply_chat_template(CONVERSATION) == oracle

    vllm_mode = create_engine_config(model=folder, generation_config="vllm").model_config
    assert vllm_mode.default_sampling_params == {}
    assert vllm_mode.generation_eos_token_ids == [model_eos, tokens[stop_at]]  # as in vLLM: still stop tokens


def test_bad_generation_config_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        create_engine_config(model=tiny_model_dir("llama"), generation_config=str(tmp_path / "missing"))
    folder = _model_with_generation_config(tiny_model_dir("llama"), tmp_path / "m", {"top_p": 1.5})
    with pytest.raises(ValueError, match="generation_config.*top_p"):
        create_engine_config(model=folder)


# -------------------------------------------------- KV sizing on a GPU (mocked)


def test_gpu_memory_utilization_sizes_the_kv_cache(tiny_model_dir, monkeypatch):
    """KV bytes = utilization x total - what this rank already holds - its
    activation peak; memory other processes hold does not count, but must
    leave the fraction free at start-up. (The GPU is simulated: no profiling
    step runs, its peak is given.)"""
    from raylm.worker import worker as worker_module

    gib = 2**30
    config = create_engine_config(model=tiny_model_dir("llama"), device="cpu", gpu_memory_utilization=0.5)
    worker = worker_module.Worker(config)
    worker.device = torch.device("cuda:0")
    worker._cuda_free_at_start = 60 * gib  # 20 GiB of 80 held by other processes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (58 * gib, 80 * gib))  # 2 GiB of weights
    monkeypatch.setattr(worker_module, "measure_peak_activation_bytes", lambda step, memory: gib // 4)
    monkeypatch.setattr(worker_module, "largest_prefill_attention", lambda *args: contextlib.nullcontext())
    assert worker.determine_available_memory() == 40 * gib - 2 * gib - gib // 4
    config.cache_config.gpu_memory_utilization = 0.8  # 64 GiB wanted, 60 free
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: 0.8 .* 60.0 GiB was free"):
        worker.determine_available_memory()


# ------------------------------------------------- the scripted vLLM launch line


def _self_signed_certificate(folder) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_file, cert_file = folder / "key.pem", folder / "cert.pem"
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_file), str(cert_file)


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_flags")
    key_file, cert_file = _self_signed_certificate(folder)
    (folder / "generation").mkdir()
    (folder / "generation" / "generation_config.json").write_text(json.dumps(GENERATION_DEFAULTS))
    (folder / "template.jinja").write_text(CHAT_TEMPLATE)
    launch_line = [
        "--dtype",
        "auto",
        "--tensor-parallel-size",
        "1",
        "--seed",
        "0",
        "--max-model-len",
        "0.5k",
        "--gpu-memory-utilization",
        "0.85",
        "--enable-prefix-caching",
        "--trust-remote-code",
        "--enforce-eager",
        "--disable-log-requests",
        "--uvicorn-log-level",
        "warning",
        "--chat-template",
        str(folder / "template.jinja"),
        "--generation-config",
        str(folder / "generation"),
        "--allowed-origins",
        json.dumps([ORIGIN]),
        "--allowed-methods",
        '["GET", "POST"]',
        "--allowed-headers",
        '["Authorization", "Content-Type"]',
        "--allow-credentials",
        "--ssl-keyfile",
        key_file,
        "--ssl-certfile",
        cert_file,
    ]
    env = {"VLLM_API_KEY": API_KEY, "RAYLM_API_KEY": ""}
    server = RaylmServer(
        tiny_model_dir("llama"), launch_line, str(folder / "server.log"), tls_ca_file=cert_file, env=env
    )
    client = httpx.Client(
        base_url=server.base_url, verify=server.verify, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    try:
        yield server, client
    finally:
        client.close()
        server.terminate()


def test_launch_line_serves_over_https_with_startup_line_and_notices(vllm_server):
    server, client = vllm_server
    assert server.base_url.startswith("https://")
    models = client.get("/v1/models").json()["data"]
    assert models[0]["id"] == MODEL_NAME and models[0]["max_model_len"] == 500
    body = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 4}).json()
    assert body["usage"]["completion_tokens"] >= 1
    log = server.log()
    assert f"on {server.base_url} | tp=1 pp=1 dp=1 | executor=uni device=cpu" in log
    for notice in (
        "gpu_memory_utilization applies to GPUs",
        "runs no code from model repositories",
        "captures no CUDA graphs",
    ):
        assert notice in log
    # Plain http to the TLS port is not served.
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.base_url.replace("https", "http", 1) + "/health", timeout=5).raise_for_status()


def test_api_key_from_vllm_env_var(vllm_server):
    server, client = vllm_server
    anonymous = httpx.post(
        server.url("/v1/completions"),
        verify=server.verify,
        timeout=30,
        json={"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 1},
    )
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"


def test_cors_preflight_answers_the_allowed_origin(vllm_server):
    server, _ = vllm_server
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(
        server.url("/v1/completions"), verify=server.verify, headers={"Origin": ORIGIN, **preflight}
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    refused = httpx.options(
        server.url("/v1/completions"), verify=server.verify, headers={"Origin": "https://evil.example", **preflight}
    )
    assert "access-control-allow-origin" not in refused.headers


def test_generation_config_folder_defaults_equal_explicit_params(vllm_server):
    _, client = vllm_server
    base = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 16, "seed": 11}

    def text(**params) -> str:
        response = client.post("/v1/completions", json={**base, **params})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    defaults = text()
    assert defaults == text(**GENERATION_DEFAULTS)
    assert defaults != text(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, repetition_penalty=1.0)


def test_chat_template_flag_renders_chat(vllm_server, tiny_model_dir):
    """A greedy chat reply equals a greedy completion of the prompt that
    --chat-template renders (rendered here by transformers)."""
    _, client = vllm_server
    tokenizer = load_tokenizer(tiny_model_dir("llama"))
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    ids = encode_rendered_chat(tokenizer, rendered)
    default_ids = encode_rendered_chat(
        tokenizer, tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    )
    assert ids != default_ids
    chat = client.post(
        "/v1/chat/completions", json={"model": MODEL_NAME, "messages": CONVERSATION, "max_tokens": 8, "temperature": 0}
    ).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    completion = client.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 8, "temperature": 0}
    ).json()
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
