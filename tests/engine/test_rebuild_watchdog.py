"""An engine core rebuilding its executor in place sends nothing until it is
done; it says so first (EngineCoreOutputs.rebuilding), so its front end gives
it the start timeout, not the step deadline: a long rebuild is not taken for a
hang, and a stuck one is still killed, with or without requests waiting.

The rebuild is held open by the test through files (tests/engine/start_hangs.py),
not by a slow machine; waiting longer than the step deadline proves nothing
was killed whatever the machine's speed."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from raylm.config import create_engine_config
from raylm.engine.errors import EngineDeadError
from raylm.engine.supervisor import AsyncEngineCoreSupervisor
from tests.engine.start_hangs import GATE_DIR_ENV, GatedRebuildUniExecutor

STEP_DEADLINE_S = 1.0


async def _next(client: AsyncEngineCoreSupervisor, within_s: float = 60.0):
    return await asyncio.wait_for(client.get_output(), within_s)


async def _until_rebuilding(client: AsyncEngineCoreSupervisor) -> None:
    while client.channels[0].rebuilding_since is None:
        await _next(client)


@pytest.mark.timeout(180)
def test_a_long_rebuild_is_not_killed_and_a_stuck_one_is(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(GATE_DIR_ENV, str(tmp_path))
    config = create_engine_config(
        tiny_model_dir("llama"),
        distributed_executor_backend=GatedRebuildUniExecutor,
        kv_cache_memory_bytes=4 << 20,
        max_model_len=256,
        num_threads=1,
        execute_model_timeout=STEP_DEADLINE_S,
        health_check_interval=0.2,
    )
    hold, fail = pathlib.Path(tmp_path, "hold"), pathlib.Path(tmp_path, "fail")
    client = AsyncEngineCoreSupervisor(config)
    client.restart_budget.max_restarts = 0  # a killed core is not replaced: its death is what the test reads
    core = client.channels[0]
    process = client.launcher._processes[0]
    try:

        async def run() -> None:
            hold.touch()
            fail.touch()  # the idle core's next health check fails: it rebuilds, and waits for `hold`
            await _until_rebuilding(client)
            # Requests in flight, as far as the watchdog knows, and the core
            # silent for several step deadlines: not killed.
            core.in_flight.add("in flight")
            with pytest.raises(asyncio.TimeoutError):
                await _next(client, within_s=4 * STEP_DEADLINE_S)
            assert process.is_alive() and core.rebuilding_since is not None
            hold.unlink()
            while core.rebuilding_since is not None:  # its next message says it is done
                outputs = await _next(client)
            assert [r.kind for r in outputs.recoveries] == ["hang"]
            core.in_flight.clear()

            # A rebuild past the start timeout is stuck: killed, idle or not.
            hold.touch()
            fail.touch()
            await _until_rebuilding(client)
            client.config.fault_tolerance.engine_start_timeout_s = STEP_DEADLINE_S  # the supervisor's copy
            with pytest.raises(EngineDeadError, match="rebuilding its executor"):
                await _next(client)
            assert not process.is_alive()

        asyncio.run(run())
    finally:
        hold.unlink(missing_ok=True)
        client.shutdown()
