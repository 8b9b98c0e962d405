"""No process can hurt the data-parallel channels (issue 20): while a DP=2
engine serves, foreign sockets connect to every socket the front end listens
on (replicas listen on none of theirs) and send garbage and well-formed
messages; none gets through the CURVE handshake, nothing is stolen, forged or
ended. A replica's own key speaks for that replica's requests only. The two
attack tests share one DP=2 engine (each ends with it serving, on the replicas
it started with, and reads the drop counters as differences); once it is shut
down, no replica actor or placement group is left."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import msgspec
import psutil
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from raylm import LLM, SamplingParams
from raylm.core.outputs import EngineCoreOutput
from raylm.distributed.tcp_auth import CurveKeys, secure_client
from raylm.engine.dp_manager import ReplicaCoreProc
from raylm.engine.protocol import AbortRequests, EngineCoreOutputs, EngineCoreRequest, Ping, Shutdown
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import STRAGGLER_TOKEN, our_live_ray_state, straggling, wait_until

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Every prompt starts with STRAGGLER_TOKEN (the others are 3..252), on which
# the engine's steps are slowed (`dp_llm`): the attacks land while requests run.
PROMPTS = [[STRAGGLER_TOKEN] + [(5 * i + j) % 250 + 3 for j in range(2 + 3 * i)] for i in range(12)]
# A hang guard for things that happen in the background, not a speed assertion.
_DEADLINE_S = 60.0
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference(model):
    return [r.token_ids for r in hf_greedy(model, PROMPTS, MAX_TOKENS)]


@pytest.fixture(scope="module")
def dp_llm(model):
    """One DP=2 engine for the attack tests (its start costs more than an attack)."""
    import ray

    if not ray.is_initialized():
        # As tests/conftest.py's ray_session does (a module fixture cannot use it).
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    with pytest.MonkeyPatch.context() as patch:  # the variable is read at the engine's start
        straggling(patch, ms=10)
        llm = LLM(model, dtype="float32", data_parallel_size=2, num_threads=1, kv_cache_memory_bytes=16 << 20)
    yield llm
    llm.shutdown()
    _assert_nothing_left()


def _assert_nothing_left() -> None:
    live_actors, live_pgs = our_live_ray_state()
    assert not live_actors, f"actors left: {[a['ActorClassName'] for a in live_actors]}"
    assert not live_pgs, "placement groups left"


def _forged_frames(request_ids: list[str]) -> list[bytes]:
    """Garbage, and well-formed messages of both directions: outputs that
    would finish every request with wrong tokens, a replica's last words, and
    a request, an abort of everything and a Shutdown for a replica."""
    encode = msgspec.msgpack.encode
    frames = [b"", b"\xc1", b"\x00not msgpack\xff" * 8, encode({"outputs": "nope"})]
    for index in (0, 1):
        outputs = [EngineCoreOutput(rid, [1, 2, 3], finish_reason="length") for rid in request_ids]
        frames.append(encode(EngineCoreOutputs(outputs=outputs, engine_index=index)))
        frames.append(encode(EngineCoreOutputs(error="Traceback\nRuntimeError: forged", engine_index=index)))
    frames.append(encode(EngineCoreRequest("forged", [3, 4, 5], GREEDY, None, 0.0)))
    frames.append(encode(AbortRequests(list(request_ids))))
    frames.append(encode(Shutdown()))
    return frames


class _Intruder:
    """Foreign sockets on one address, each with a monitor that tells how its
    handshakes went: plain ones, and CURVE ones with a key of their own that
    even know the front end's public key."""

    def __init__(self, ctx: zmq.Context, address: str, server_key: bytes):
        self.sockets: list[tuple[zmq.Socket, zmq.Socket, bool]] = []
        for kind in (zmq.PUSH, zmq.PULL, zmq.DEALER):
            for curve in (False, True):
                sock = ctx.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                if curve:
                    secure_client(sock, CurveKeys.generate(), server_key=server_key)
                monitor = sock.get_monitor_socket()
                sock.connect(address)
                self.sockets.append((sock, monitor, curve))
        self.events: dict[int, list[int]] = {i: [] for i in range(len(self.sockets))}

    def send(self, frames: list[bytes]) -> None:
        """Queued on the foreign sockets: delivered if a handshake ever succeeds."""
        for sock, _, _ in self.sockets:
            if sock.type in (zmq.PUSH, zmq.DEALER):
                for frame in frames:
                    sock.send(frame, flags=zmq.NOBLOCK)

    def read_events(self) -> None:
        for i, (_, monitor, _) in enumerate(self.sockets):
            while monitor.poll(0):
                self.events[i].append(recv_monitor_message(monitor)["event"])

    def all_refused(self) -> bool:
        self.read_events()
        return all(any(e in _HANDSHAKE_FAILED for e in events) for events in self.events.values())

    def received(self) -> list[bytes]:
        return [sock.recv() for sock, _, _ in self.sockets if sock.type in (zmq.PULL, zmq.DEALER) and sock.poll(0)]

    def close(self) -> None:
        for sock, monitor, _ in self.sockets:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)


def _step_and_pause(engine, done: dict, pause_s: float) -> None:
    """One step, its finished requests kept in `done` (a request may finish
    while a test waits on something else), then a pause."""
    for out in engine.step():
        done[out.request_id] = out.outputs[0].token_ids
    time.sleep(pause_s)


def _step_until(engine, done: dict, predicate) -> None:
    while not predicate():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids


def test_foreign_sockets_steal_inject_and_end_nothing(ray_session, dp_llm, reference):
    llm = dp_llm
    engine = llm.llm_engine
    client = engine.engine_core
    actors = {i: h.actor for i, h in client.launcher.manager.replicas.items()}
    first, second = range(0, 6), range(6, len(PROMPTS))
    for i in first:
        engine.add_request(str(i), {"prompt_token_ids": PROMPTS[i]}, GREEDY)
    done: dict[str, list[int]] = {}
    _step_until(engine, done, lambda: all(client.ledger[str(i)].token_ids for i in first))
    assert not done, "a request finished before the attack"

    # Every socket the front end listens on: the output socket and each
    # replica's input socket.
    addresses = [client.launcher.output_address] + [r.address for r in client.channels.values()]
    listening = {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert {int(a.rsplit(":", 1)[1]) for a in addresses} <= listening
    ctx = zmq.Context()
    intruders = [_Intruder(ctx, address, client.launcher.curve.keys.public) for address in addresses]
    try:
        for intruder in intruders:
            intruder.send(_forged_frames([str(i) for i in range(len(PROMPTS))]))
        wait_until(
            lambda: all(intruder.all_refused() for intruder in intruders),
            _DEADLINE_S,
            step=lambda: _step_and_pause(engine, done, 0.05),  # the requests in flight go on meanwhile
            message=lambda: f"every intruder to be refused: {[i.events for i in intruders]}",
        )
        # Sent while the foreign PULLs keep knocking: none gets a share.
        for i in second:
            engine.add_request(str(i), {"prompt_token_ids": PROMPTS[i]}, GREEDY)
        _step_until(engine, done, lambda: not engine.has_unfinished_requests())
        assert [done[str(i)] for i in range(len(PROMPTS))] == reference
        for intruder in intruders:
            intruder.read_events()
            assert all(zmq.EVENT_HANDSHAKE_SUCCEEDED not in events for events in intruder.events.values())
            # A foreign CURVE client of the right socket type is refused by
            # the key check itself, not by a mismatch of types.
            typed = [
                i
                for i, (sock, _, curve) in enumerate(intruder.sockets)
                if curve and sock.type == (zmq.PUSH if intruder is intruders[0] else zmq.PULL)
            ]
            assert all(zmq.EVENT_HANDSHAKE_FAILED_AUTH in intruder.events[i] for i in typed)
            assert intruder.received() == []
    finally:
        for intruder in intruders:
            intruder.close()
        ctx.term()

    # Nothing died or was replaced, and the engine still serves.
    assert {i: h.actor for i, h in client.launcher.manager.replicas.items()} == actors
    assert [r["state"] for r in client.replica_states()] == ["serving", "serving"]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference[:4]


def test_a_replica_speaks_only_for_itself(ray_session, dp_llm, reference, caplog):
    """A process holding replica 1's key (as replica 1 itself would) cannot
    finish replica 0's requests, sign as replica 0 or report its death, and
    what does not decode is dropped on both sides, with a warning."""
    llm = dp_llm
    caplog.set_level(logging.WARNING, logger="raylm.engine")
    engine = llm.llm_engine
    client = engine.engine_core
    actors = {i: h.actor for i, h in client.launcher.manager.replicas.items()}
    # Request ids of this test's own: the engine served the other test's.
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"own-{i}", {"prompt_token_ids": prompt}, GREEDY)
    on_replica_0 = [rid for rid, sent in client.ledger.items() if sent.channel == 0]
    assert on_replica_0
    done: dict[str, list[int]] = {}
    _step_until(engine, done, lambda: all(client.ledger[rid].token_ids for rid in on_replica_0))
    assert not done, "a request finished before the forgery"

    ctx = zmq.Context()
    posing = ctx.socket(zmq.PUSH)
    posing.setsockopt(zmq.LINGER, 0)
    secure_client(posing, client.launcher.keys_of(client.channels[1]), server_key=client.launcher.curve.keys.public)
    posing.connect(client.launcher.output_address)
    forged = [EngineCoreOutput(rid, [1, 2, 3], finish_reason="length") for rid in on_replica_0]
    encode = msgspec.msgpack.encode
    # The drop counters are the engine's: this test's drops are what they add.
    counted_before = client.foreign.count, client.launcher.misattributed.count, client.undecodable.count
    try:
        for frame in (
            b"\x00not msgpack",
            encode(EngineCoreOutputs(outputs=forged, engine_index=1)),
            encode(EngineCoreOutputs(outputs=forged, engine_index=0)),
            encode(EngineCoreOutputs(error="Traceback\nRuntimeError: forged", engine_index=0)),
        ):
            posing.send(frame)
        # The front end's own input socket carries only what it encodes;
        # a replica drops a frame that does not decode all the same.
        client.channels[0].send(b"\x00not msgpack")

        def drops() -> tuple[int, int, int]:
            counts = client.foreign.count, client.launcher.misattributed.count, client.undecodable.count
            return tuple(now - before for now, before in zip(counts, counted_before))

        def all_dropped() -> bool:
            foreign, misattributed, undecodable = drops()
            return foreign >= 1 and misattributed >= 2 and undecodable >= 1

        wait_until(
            all_dropped,
            _DEADLINE_S,
            step=lambda: _step_and_pause(engine, done, 0.01),
            message=lambda: f"the drops (foreign, misattributed, undecodable) to be counted: {drops()}",
        )
        _step_until(engine, done, lambda: not engine.has_unfinished_requests())
        # With nothing in flight a step still reads what has come (it used
        # not to: frames sent as the last request finished sat unread).
        posing.send(b"\x00late, not msgpack")
        wait_until(
            lambda: drops()[2] >= 2,
            _DEADLINE_S,
            step=lambda: _step_and_pause(engine, done, 0.01),
            message=lambda: f"a frame sent while idle to be counted: {drops()}",
        )
    finally:
        posing.close(linger=0)
        ctx.term()
    assert [done[f"own-{i}"] for i in range(len(PROMPTS))] == reference
    assert {i: h.actor for i, h in client.launcher.manager.replicas.items()} == actors
    messages = [
        r.getMessage() for r in caplog.records if r.name in ("raylm.engine.supervisor", "raylm.engine.ray_launcher")
    ]
    assert any("does not decode" in m for m in messages), messages
    assert any("not routed to the core" in m for m in messages), messages
    assert any("signed as replica 0" in m for m in messages), messages
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference[:4]


class _IdleCore:
    """An engine core with nothing to do: the loop around it is under test."""

    recoveries: list = []
    unhealthy_reason = None
    worker_threads = 0
    migrations = SimpleNamespace(copying=False)  # no K/V being imported beside the steps

    def has_unfinished_requests(self) -> bool:
        return False

    def has_work_in_flight(self) -> bool:
        return False

    def check_health_if_due(self) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def take_migration_reports(self, message=None) -> list:
        return []  # nothing migrates in or out of an idle core

    def record_kv_events(self) -> None:
        pass

    def take_kv_events(self) -> None:
        return None  # an idle core's prefix cache does not change


def test_a_replica_drops_an_input_frame_that_does_not_decode(tmp_path, caplog):
    """A replica's core loop (no Ray needed): a stray frame is logged and
    dropped, and the messages after it are served."""
    ctx = zmq.Context()
    to_core, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_core.bind(f"ipc://{tmp_path}/input")
    from_core.bind(f"ipc://{tmp_path}/output")
    proc = ReplicaCoreProc(
        _IdleCore(), f"ipc://{tmp_path}/input", f"ipc://{tmp_path}/output", engine_index=3, watch_parent=False
    )
    try:
        for frame in (
            b"\x00not msgpack",
            msgspec.msgpack.encode({"nonce": 1}),
            msgspec.msgpack.encode(Ping(7)),
            msgspec.msgpack.encode(Shutdown()),
        ):
            to_core.send(frame)
        with caplog.at_level(logging.WARNING, logger="raylm.engine.dp_manager"):
            proc.run()  # returns at the Shutdown
        reply = msgspec.msgpack.decode(from_core.recv(), type=EngineCoreOutputs)
        assert (reply.pong, reply.engine_index) == (7, 3)
        assert "(2 so far)" in caplog.text
    finally:
        proc.close()
        to_core.close(linger=0)
        from_core.close(linger=0)
        ctx.term()
