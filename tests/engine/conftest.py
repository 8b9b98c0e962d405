"""An AsyncLLM front end driven by a scripted fake engine core."""

from __future__ import annotations

import asyncio

import pytest

import raylm.engine.async_llm as async_llm_module
from raylm.config import create_engine_config
from raylm.engine.async_llm import AsyncLLM, StatLoggerBase
from raylm.engine.core_proc import EngineCoreOutputs


class FakeCore:
    """Stands in for MPClient: records what it is sent and replays what the
    test puts in `script` (EngineCoreOutputs, or an exception to raise)."""

    started: list["FakeCore"] = []

    def __init__(self, config, log_level=None, is_busy=None):
        self.requests = []
        self.aborted: list[str] = []
        self.script: asyncio.Queue = asyncio.Queue()
        self.closed = False
        FakeCore.started.append(self)

    def add_request(self, request) -> None:
        self.requests.append(request)

    def abort_requests(self, request_ids) -> None:
        self.aborted.extend(request_ids)

    def is_alive(self) -> bool:
        return True

    def running_alone(self):
        return None  # this fake never quarantines

    async def get_output(self) -> EngineCoreOutputs:
        item = await self.script.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def shutdown(self) -> None:
        self.closed = True


class Recoveries(StatLoggerBase):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def record_recovery(self, kind: str, seconds: float, num_requests: int) -> None:
        self.seen.append((kind, num_requests))


@pytest.fixture
def make_engine(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(async_llm_module, "MPClient", FakeCore)
    FakeCore.started = []
    engines = []

    def make(**kwargs) -> tuple[AsyncLLM, Recoveries]:
        stats = Recoveries()
        engine = AsyncLLM(create_engine_config(tiny_model_dir("llama"), **kwargs), [stats])
        engines.append(engine)
        return engine, stats

    yield make
    for engine in engines:
        engine.shutdown()


