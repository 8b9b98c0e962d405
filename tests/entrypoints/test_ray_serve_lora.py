"""raylm.ray_serve passes LoRA adapters through as `raylm serve` takes them:
lora_modules in both of vLLM's forms (and as dicts), checked in the replica
against the base model and served by name; run-time updating is refused
under Serve (a load would reach only the replica Serve sent it to)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from transformers import AutoTokenizer

from raylm.config import create_engine_config
from raylm.engine.input_processor import InputProcessor
from raylm.entrypoints.openai.metrics import PrometheusStatLogger
from raylm.entrypoints.openai.serving_lora import LoRAModule
from raylm.ray_serve import build_replica_app, settings_from_strings, split_settings
from raylm.testing.lora_oracle import make_tiny_adapter


def test_lora_settings_parse_as_the_flags_do():
    settings, _ = settings_from_strings({"enable-lora": "true", "lora-modules": "a=/p/a,b=/p/b"})
    _, server = split_settings(settings)
    assert server["lora_modules"] == [LoRAModule("a", "/p/a"), LoRAModule("b", "/p/b")]
    _, server = split_settings(
        {"enable_lora": True, "lora_modules": ["a=/p/a", {"name": "b", "path": "/p/b", "base_model_name": "m"}]}
    )
    assert server["lora_modules"] == [LoRAModule("a", "/p/a"), LoRAModule("b", "/p/b", "m")]


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"lora_modules": ["a=/p"]}, "needs enable_lora"),
        ({"enable_lora": True, "lora_modules": ["nope"]}, "lora_modules"),
        ({"enable_lora": True, "allow_runtime_lora_updating": True}, "not under Ray Serve"),
        ({"enable_lora": True, "max_served_loras": 0}, "max_served_loras"),
    ],
)
def test_lora_settings_a_replica_cannot_serve_are_refused_at_build(settings, field):
    with pytest.raises(ValueError, match=field):
        split_settings(settings)


def test_a_replica_serves_its_lora_modules_by_name(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    adapter = make_tiny_adapter(model, tmp_path / "a", seed=1, rank=4)
    config = create_engine_config(model, dtype="float32", enable_lora=True, max_lora_rank=8)
    engine = SimpleNamespace(
        config=config,
        input_processor=InputProcessor(config.model_config, AutoTokenizer.from_pretrained(model), config.lora_config),
        replica_states=lambda: None,
    )
    _, server = split_settings({"enable_lora": True, "lora_modules": [f"a={adapter}"], "api_key": "k"})
    app = build_replica_app(engine, ["m"], server, PrometheusStatLogger("m"))

    async def models() -> list[dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
            return response.json()["data"]

    cards = asyncio.run(models())
    assert [(c["id"], c["parent"]) for c in cards] == [("m", None), ("a", "m")]
    assert app.state.adapters.resolve("a")[1].lora_path == adapter
    assert not app.state.adapters.runtime_updating
