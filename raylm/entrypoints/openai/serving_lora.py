"""LoRA adapters served by name (issue 53, online): `--lora-modules` at
start, `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` at run
time (vLLM's routes), and a request's `model` naming an adapter.

`ServedAdapters` is the server's catalogue: adapter name -> LoRARequest
(its id given here, its path). A request naming an adapter runs with it;
the engine stamps the adapter's content digest at intake, as for an
offline request (raylm.lora.registry), so files rewritten in place are read
and checked again and never share K/V with the old weights.

Run-time updating is off unless the server was started with
--allow-runtime-lora-updating (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING);
then paths are confined to --lora-directory (resolved: a symlink may not
lead out), the catalogue holds at most `max_adapters` adapters, and a bad
adapter is refused with a 400 naming the problem, the catalogue unchanged.
Unloading waits: the name leaves at once (new requests for it get 404),
and the answer comes once no request that runs with it is left, in the
engine or on its way there (`holding`).
The routes are behind the API key; a server bound to a non-loopback
address refuses to start with them on and no key (cli_args.run_serve).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel

from raylm.entrypoints.openai.protocol import ModelCard
from raylm.entrypoints.openai.serving_common import OpenAIError
from raylm.lora.request import LoRARequest

# vLLM's switch for the run-time routes, honoured beside raylm's flag.
RUNTIME_UPDATING_ENV_VAR = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
DEFAULT_MAX_SERVED_LORAS = 64
# An adapter's name is a model name clients send: bounded, printable.
MAX_NAME_CHARS = 256
# How often an unload looks whether the adapter's last request finished.
_UNLOAD_POLL_S = 0.05


@dataclass(frozen=True)
class LoRAModule:
    """One adapter of --lora-modules: its name, its folder, the base model it is for."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """--lora-modules' forms, as vLLM's: `name=path`, or a JSON object
    {"name": ..., "path": ..., "base_model_name": ...}."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: not JSON ({e}): {text!r}") from None
        unknown = set(value) - {"name", "path", "base_model_name"} if isinstance(value, dict) else set()
        if not isinstance(value, dict) or unknown:
            raise argparse.ArgumentTypeError(
                f"--lora-modules: a JSON object with name, path and base_model_name expected, got {text!r}"
            )
        name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
        if not isinstance(base, (str, type(None))):
            raise argparse.ArgumentTypeError(f"--lora-modules: base_model_name must be a string, got {base!r}")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path or a JSON object, got {text!r}")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: both a name and a path are needed, got {text!r}")
    return LoRAModule(name, path, base)


def runtime_updating_from_env() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV_VAR, "").strip().lower() in ("1", "true", "yes")


def confined_path(directory: str, path: str) -> str:
    """`path` (absolute, or relative to `directory`) resolved, every symlink
    followed; a ValueError unless it lies inside `directory`."""
    root = os.path.realpath(directory)
    real = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, real]) != root:
        raise ValueError(f"lora_path {path!r} is outside the server's --lora-directory")
    return real


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field: the name decides here


class ServedAdapters:
    """The adapters the server serves by name, beside the base model's names."""

    def __init__(
        self,
        engine,
        base_names: list[str],
        max_adapters: int = DEFAULT_MAX_SERVED_LORAS,
        lora_directory: str | None = None,
    ):
        """`lora_directory`: where run-time loads may read (None: run-time
        updating is off)."""
        self.engine, self.base_names, self.max_adapters = engine, base_names, max_adapters
        self.lora_directory = lora_directory
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._lock = asyncio.Lock()  # one load or unload at a time
        # Adapter id -> requests between their name's lookup and the engine
        # (`holding`): an unload waits for them as for the engine's.
        self._held: collections.Counter[int] = collections.Counter()

    @property
    def runtime_updating(self) -> bool:
        return self.lora_directory is not None

    def names(self) -> list[str]:
        return list(self._by_name)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter at `path` against the base model (its files read,
        in the caller's thread) and serve it as `name`; ValueError naming the
        problem, the catalogue unchanged."""
        self._check_name(name)
        if len(self._by_name) >= self.max_adapters:
            raise ValueError(f"lora_name: the server serves {self.max_adapters} adapters already, its most")
        request = LoRARequest(name, self._next_id, path, base_model_name)
        self.engine.input_processor.check_lora_request(request)
        self._next_id += 1
        self._by_name[name] = request
        return request

    def _check_name(self, name: str) -> None:
        if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
            raise ValueError(f"lora_name must be 1 to {MAX_NAME_CHARS} printable characters")
        if name in self.base_names:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        if name in self._by_name:
            raise ValueError(f"lora_name: the adapter {name!r} has already been loaded")

    def resolve(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(the model name answered with, the adapter to run with): no name
        is the base model; an unknown one is a 404, as in vLLM's server."""
        if model is None or model == "":
            return self.base_names[0], None
        if model in self.base_names:
            return model, None
        adapter = self._by_name.get(model)
        if adapter is None:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model", "NotFoundError")
        return model, adapter

    @contextlib.contextmanager
    def holding(self, model: str | None):
        """Around a request's handler: if `model` names an adapter, the
        request counts as using it until the handler returns (by then it is
        in the engine, or refused), so that an unload never answers while a
        request that looked the name up is still on its way there."""
        adapter = self._by_name.get(model) if isinstance(model, str) else None
        if adapter is None:
            yield
            return
        self._held[adapter.lora_int_id] += 1
        try:
            yield
        finally:
            self._held[adapter.lora_int_id] -= 1
            if not self._held[adapter.lora_int_id]:
                del self._held[adapter.lora_int_id]

    def cards(self, root: str, max_model_len: int) -> list[ModelCard]:
        """/v1/models: the base model's names, then each adapter with its base as parent."""
        base = [ModelCard(id=name, root=root, max_model_len=max_model_len) for name in self.base_names]
        adapters = [
            ModelCard(
                id=name,
                root=request.lora_path,
                parent=request.base_model_name or self.base_names[0],
                max_model_len=max_model_len,
            )
            for name, request in self._by_name.items()
        ]
        return base + adapters

    async def load(self, name: str, path: str) -> None:
        if not self.runtime_updating:
            raise OpenAIError(_OFF, 404)
        async with self._lock:
            try:
                real = confined_path(self.lora_directory, path)
                self._check_name(name)  # before the files are read
                await asyncio.get_running_loop().run_in_executor(None, self.add, name, real)
            except ValueError as e:
                raise OpenAIError(" ".join(str(e).split()), 400, _param_of(e)) from e

    async def unload(self, name: str) -> None:
        """The name leaves now; the answer waits until no request runs with
        the adapter, in the engine or on its way there (`holding`)."""
        if not self.runtime_updating:
            raise OpenAIError(_OFF, 404)
        async with self._lock:
            adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name", "NotFoundError")
        while self._held[adapter.lora_int_id] or self.engine.num_requests_with_adapter(adapter.lora_int_id):
            await asyncio.sleep(_UNLOAD_POLL_S)


_OFF = "run-time LoRA updating is off; start the server with --allow-runtime-lora-updating and --lora-directory"


def _param_of(error: ValueError) -> str:
    return "lora_name" if str(error).startswith("lora_name") else "lora_path"


def install_lora_routes(app: FastAPI, adapters: ServedAdapters) -> None:
    """vLLM's run-time routes (the API key middleware guards them as every route)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        await adapters.load(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        await adapters.unload(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")
