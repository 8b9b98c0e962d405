"""The front end's client for data-parallel replicas (DESIGN.md, "Data parallel
on Ray"): one ZMQ/msgpack channel per replica, exactly as to a local core, a
router, and the healing of replicas that die.

Routing. A request goes to the replica with the lowest load score

    score = in_flight + 2 * waiting + kv_cache_usage

where `in_flight` counts the requests this client sent it that have not
finished (exact and immediate), `waiting` is the replica's own count of queued
requests at its last report (queued work costs more than running work: it
waits for a batch slot), and `kv_cache_usage` (0..1) breaks ties towards the
emptier cache. With prefix affinity, a request whose prompt starts with the
same `AFFINITY_TOKENS` tokens as an earlier one goes to that one's replica
(its prefix cache holds them) unless that replica is busier than the least
busy by more than `AFFINITY_SLACK`. `data_parallel_rank` pins a replica.

Failures. This client remembers every request it sent and the tokens that
came back for it; when a replica dies it resubmits the unfinished ones to the
survivors as continuations (prompt plus tokens so far, see Request), and the
manager starts a replacement within the restart budget. The front end above
sees a pause, not an error.

Trust. Every channel is ZMQ CURVE (`_bind_output`, `_new_channel`, and
dp_manager.ReplicaChannel on the replica's side): each replica has a keypair
of its own (through Ray, never a socket), and the front end admits on a
replica's input socket that replica's key only, and on the output socket its
replicas' keys only, so no other process can take requests or inject
outputs. The output socket tells from the key which replica sent a frame
(`_sender`); a replica speaks for the requests routed to it only
(`_drop_foreign_outputs`), and a frame that does not decode is dropped
(`_decode_outputs`): neither ends the server.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from raylm.config import EngineConfig
from raylm.core import quarantine
from raylm.core.outputs import EngineCoreOutput
from raylm.core.request import Request
from raylm.distributed.tcp_auth import CurveKeys, CurveServer, terminate_context
from raylm.engine.core_client import EngineDeadError, send_pending
from raylm.engine.core_proc import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    Ping,
    RecoveryStats,
    SchedulerStats,
    Shutdown,
)
from raylm.engine.dp_manager import CoreEngineActorManager, DropLog, ReplicaChannel, RunningAloneRecordInRay
from raylm.engine.restart_budget import BlameLedger, RestartBudget

logger = logging.getLogger(__name__)

AFFINITY_TOKENS = 64
AFFINITY_SLACK = 4
_AFFINITY_ENTRIES = 16384
_POLL_MS = 100
# The ZAP domain of the output socket (each input socket has its replica's).
_OUTPUT_DOMAIN = "raylm-dp-output"
# Aborted requests remembered per replica: their last outputs may cross the abort.
_ABORTS_REMEMBERED = 1024


def _input_domain(index: int) -> str:
    return f"raylm-dp-input-{index}"


@dataclass
class _Replica:
    index: int
    input: zmq.Socket
    address: str
    keys: CurveKeys
    unsent: deque = field(default_factory=deque)
    aborted: deque = field(default_factory=lambda: deque(maxlen=_ABORTS_REMEMBERED))
    in_flight: set[str] = field(default_factory=set)
    stats: SchedulerStats | None = None
    draining: bool = False
    num_routed: int = 0
    node_ip: str = ""
    # When it last sent anything, or was given work while idle (see _kill_hung_replicas).
    last_heard: float = field(default_factory=time.monotonic)
    # It announced a rebuild of its executor and has sent nothing since.
    rebuilding: bool = False

    @property
    def score(self) -> float:
        waiting = self.stats.num_waiting if self.stats else 0
        usage = self.stats.kv_cache_usage if self.stats else 0.0
        return len(self.in_flight) + 2 * waiting + usage


class _ReplicaKeys:
    """The replicas' public keys that the front end's sockets admit, shared
    with the ZAP thread (single dict reads and writes, atomic in Python).
    Only live channels are here: a replaced replica's key stops working."""

    def __init__(self):
        self.replicas: dict[bytes, _Replica] = {}

    def admits(self, domain: str, client_key: bytes) -> bool:
        replica = self.replicas.get(client_key)
        return replica is not None and domain in (_OUTPUT_DOMAIN, _input_domain(replica.index))


@dataclass
class _Sent:
    """A request as first sent, and the tokens that came back for it."""

    request: Request
    replica: int
    token_ids: list[int] = field(default_factory=list)


class DPClient:
    """Replicas as core clients behind one interface (add_request,
    abort_requests, ping, is_alive, get_output, shutdown); `AsyncDPClient` and
    `SyncDPClient` differ only in how `get_output` waits."""

    asyncio_mode = False

    def __init__(self, config: EngineConfig):
        pc = config.parallel_config
        self.config = config
        self.prefix_affinity = pc.data_parallel_prefix_affinity
        ft = config.fault_tolerance
        self.restart_budget = RestartBudget(ft.max_restarts, ft.restart_window_s)
        # Replica restarts that failed requests caused are forgiven, up to a rate.
        self.blame = BlameLedger(self.restart_budget, ft.max_blamed_recoveries, ft.restart_window_s)
        self._ctx = zmq.Context()
        self._replica_keys = _ReplicaKeys()
        self._undecodable = DropLog("a replica message that does not decode", logger)
        self._misattributed = DropLog("a replica message signed with another replica's index", logger)
        self._foreign = DropLog("outputs for requests not routed to the replica that sent them", logger)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.replicas: dict[int, _Replica] = {}
        self._sent: dict[str, _Sent] = {}
        self._homeless: list[Request] = []  # routed when a replica is up again
        self._affinity: OrderedDict[int, int] = OrderedDict()
        self._deaths: queue.Queue = queue.Queue()
        self._started: queue.Queue = queue.Queue()
        self._starting: set[int] = set()
        self._recoveries: list[RecoveryStats] = []
        # Culprits of replica deaths (raylm.core.quarantine), to pass up as their outputs.
        self._culprit_outputs: list[EngineCoreOutput] = []
        self._pings: dict[int, set[int]] = {}
        self._nonce = 0
        self.dead_error: EngineDeadError | None = None
        self.manager = CoreEngineActorManager(config, on_death=lambda i, cause: self._deaths.put((i, cause)))
        self._host = self._front_end_host()
        # Made before any socket is bound: no client may connect unchecked.
        self._curve = CurveServer(self._ctx, CurveKeys.generate(), admits=self._replica_keys.admits)
        self._output, self.output_address = self._bind_output()
        self._finalizer = weakref.finalize(self, _shutdown, self.manager, self.replicas, self._output,
                                           self._curve, self._ctx)
        try:
            self._start_replicas(list(range(pc.data_parallel_size)))
        except BaseException:
            self._finalizer()
            raise

    def _front_end_host(self) -> str:
        """Replicas on other hosts reach us at this node's IP; on one host, loopback."""
        import ray

        ips = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        return "127.0.0.1" if len(ips) <= 1 else ray.util.get_node_ip_address()

    # ---- the transport: sockets, keys, who sent what -------------------------------

    def _bind_output(self) -> tuple[zmq.Socket, str]:
        """The socket every replica sends its outputs to; replicas' keys only.
        In the one context of the ZAP handler, whatever the client's mode."""
        socket = self._ctx.socket(zmq.PULL)
        self._curve.secure(socket, _OUTPUT_DOMAIN)
        port = socket.bind_to_random_port(f"tcp://{self._host}")
        if self.asyncio_mode:
            socket = zmq.asyncio.Socket.from_socket(socket)
        return socket, f"tcp://{self._host}:{port}"

    def _new_channel(self, index: int) -> _Replica:
        """A replica's input socket and keypair; its key is admitted from now
        until `_close_channel` (the replica connects while it starts)."""
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        self._curve.secure(socket, _input_domain(index))
        port = socket.bind_to_random_port(f"tcp://{self._host}")
        replica = _Replica(index, socket, f"tcp://{self._host}:{port}", CurveKeys.generate())
        self._replica_keys.replicas[replica.keys.public] = replica
        return replica

    def _replica_channel(self, replica: _Replica) -> ReplicaChannel:
        """What the replica's actor is given (through Ray) to connect with."""
        return ReplicaChannel(replica.address, self.output_address, replica.keys, self._curve.keys.public,
                              self._running_alone(replica.index).key.decode())

    def _running_alone(self, index: int) -> RunningAloneRecordInRay:
        """Replica `index`'s record of the quarantined request it runs alone."""
        return RunningAloneRecordInRay(f"raylm-running-alone-{id(self):x}-{os.getpid()}-{index}")

    def _close_channel(self, replica: _Replica) -> None:
        self._replica_keys.replicas.pop(replica.keys.public, None)
        replica.input.close()

    def _sender(self, frame: zmq.Frame) -> _Replica | None:
        """The serving replica whose key sent `frame` (CURVE tells the key),
        or None: a replica given up on (what it sent before it was is still
        arriving) or not yet adopted. Nobody else can have sent it."""
        replica = self._replica_keys.replicas.get(frame.get("User-Id").encode())
        if replica is None or self.replicas.get(replica.index) is not replica:
            logger.debug("dropped a message from a data-parallel replica no longer (or not yet) serving")
            return None
        return replica

    def _decode_outputs(self, frame: zmq.Frame) -> tuple[_Replica, EngineCoreOutputs] | None:
        """A frame's sender and message, or None when it is to be dropped."""
        replica = self._sender(frame)
        if replica is None:
            return None
        try:
            outputs = self._decoder.decode(frame.buffer)
        except msgspec.DecodeError as e:
            self._undecodable.dropped(f"from replica {replica.index}: {e}")
            return None
        if outputs.engine_index != replica.index:
            self._misattributed.dropped(f"replica {replica.index} signed as replica {outputs.engine_index}")
            return None
        return replica, outputs

    def _drop_foreign_outputs(self, replica: _Replica, outputs: EngineCoreOutputs) -> None:
        """Keep only the outputs of requests routed to `replica`: it may not
        speak for another's. Outputs of a request it was told to abort are
        expected (they cross the abort) and dropped quietly."""
        kept = []
        for out in outputs.outputs:
            sent = self._sent.get(out.request_id)
            if sent is not None and sent.replica == replica.index:
                kept.append(out)
            elif out.request_id not in replica.aborted:
                self._foreign.dropped(f"replica {replica.index} sent request {out.request_id[:64]!r}")
        outputs.outputs = kept

    # ---- replicas -----------------------------------------------------------------

    def _start_replicas(self, indices: list[int]) -> None:
        """Start replicas and wait until they all serve (they load in parallel)."""
        channels, targets = self._new_channels(indices)
        try:
            self._wait_started(channels, targets)
        except BaseException:
            for channel in channels:
                self._close_channel(channel)
            raise
        self._adopt(channels)

    def _new_channels(self, indices: list[int]) -> tuple[list[_Replica], list]:
        return [self._new_channel(i) for i in indices], self.manager.plan_nodes(len(indices))

    def _wait_started(self, channels: list[_Replica], targets: list) -> None:
        """Blocking, and touches no socket (any thread may run it): start the
        replicas in parallel; on any failure none of them is left running."""
        errors: list[BaseException] = []

        def start(channel: _Replica, target) -> None:
            try:
                handle = self.manager.start_replica(channel.index, self._replica_channel(channel), target)
                channel.node_ip = handle.node_ip
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=start, args=(c, t), name=f"raylm-dp-start-{c.index}")
                   for c, t in zip(channels, targets)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            for channel in channels:
                self.manager.stop_replica(channel.index, wait_s=0)
            raise errors[0]

    def _adopt(self, channels: list[_Replica]) -> None:
        for channel in channels:
            self.replicas[channel.index] = channel

    def _replace_in_background(self, index: int) -> None:
        channel = self._new_channel(index)
        self._starting.add(index)
        target = self.manager.plan_nodes(1)[0]

        def start() -> None:
            started = time.monotonic()
            try:
                handle = self.manager.start_replica(index, self._replica_channel(channel), target)
                channel.node_ip = handle.node_ip
                self._started.put((channel, None, time.monotonic() - started))
            except BaseException as e:
                self._started.put((channel, e, time.monotonic() - started))

        threading.Thread(target=start, name=f"raylm-dp-replace-{index}", daemon=True).start()

    def _plan_scale(self, data_parallel_size: int) -> list[int]:
        """Drain what a scale-down removes; the new indices a scale-up needs."""
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {data_parallel_size!r}")
        active = sorted(i for i, r in self.replicas.items() if not r.draining)
        if data_parallel_size <= len(active):
            for index in active[data_parallel_size:]:
                self.replicas[index].draining = True
            self._retire_drained()
            return []
        taken = set(self.replicas) | self._starting
        free = (i for i in range(data_parallel_size + len(taken)) if i not in taken)
        return [next(free) for _ in range(data_parallel_size - len(active))]

    def scale(self, data_parallel_size: int) -> None:
        """Scale up (new replicas placed and warmed before they get traffic) or
        down (the highest replicas get no new requests and leave once theirs
        finish). A scale-up that cannot be placed raises and changes nothing."""
        new = self._plan_scale(data_parallel_size)
        if new:
            self._start_replicas(new)
        logger.info("data parallel size is now %d", data_parallel_size)

    def _retire_drained(self) -> None:
        for index, replica in list(self.replicas.items()):
            if replica.draining and not replica.in_flight:
                self._send_frame(replica, self._encoder.encode(Shutdown()))
                self._flush(replica)
                del self.replicas[index]
                self.manager.stop_replica(index)
                self._close_channel(replica)
                logger.info("data-parallel replica %d drained and removed", index)

    # ---- requests -------------------------------------------------------------------

    def add_request(self, request: Request, data_parallel_rank: int | None = None) -> None:
        try:
            frame = self._encoder.encode(EngineCoreRequest.from_request(request))
        except (OverflowError, msgspec.EncodeError) as e:
            raise ValueError(f"request cannot be encoded: {e}") from e
        replica = self._route(request, data_parallel_rank)
        self._sent[request.request_id] = _Sent(request, -1 if replica is None else replica.index,
                                               list(request.output_token_ids))
        if replica is None:
            self._homeless.append(request)
            return
        self._dispatch(replica, request.request_id, frame)

    def _dispatch(self, replica: _Replica, request_id: str, frame: bytes) -> None:
        if not replica.in_flight:
            replica.last_heard = time.monotonic()  # its silence while idle was no hang
        replica.in_flight.add(request_id)
        replica.num_routed += 1
        self._sent[request_id].replica = replica.index
        self._send_frame(replica, frame)

    def _route(self, request: Request, rank: int | None) -> _Replica | None:
        if rank is not None:
            replica = self.replicas.get(rank)
            if replica is None or replica.draining:
                raise ValueError(f"data_parallel_rank {rank} is not a serving replica "
                                 f"(serving: {sorted(i for i, r in self.replicas.items() if not r.draining)})")
            return replica
        candidates = [r for r in self.replicas.values() if not r.draining]
        if not candidates:
            return None
        best = min(candidates, key=lambda r: (r.score, r.index))
        if not self.prefix_affinity or len(request.prompt_token_ids) < AFFINITY_TOKENS:
            return best
        key = hash(tuple(request.prompt_token_ids[:AFFINITY_TOKENS]))
        preferred = self.replicas.get(self._affinity.get(key, -1))
        if preferred is not None and not preferred.draining and preferred.score <= best.score + AFFINITY_SLACK:
            best = preferred
        self._affinity[key] = best.index
        self._affinity.move_to_end(key)
        if len(self._affinity) > _AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return best

    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            sent = self._sent.pop(rid, None)
            if sent is None:
                continue
            self._homeless = [r for r in self._homeless if r.request_id != rid]
            replica = self.replicas.get(sent.replica)
            if replica is not None:
                replica.in_flight.discard(rid)
                replica.aborted.append(rid)
                by_replica.setdefault(replica.index, []).append(rid)
        for index, ids in by_replica.items():
            self._send_frame(self.replicas[index], self._encoder.encode(AbortRequests(ids)))

    def ping(self) -> int:
        """Every serving replica is asked; the pong goes up once all answered."""
        self._nonce += 1
        self._pings[self._nonce] = set(self.replicas)
        for replica in self.replicas.values():
            self._send_frame(replica, self._encoder.encode(Ping(self._nonce)))
        return self._nonce

    def is_alive(self) -> bool:
        return self.dead_error is None

    def replica_states(self) -> list[dict]:
        """For /health and logs: each replica's node, load and state."""
        states = []
        for index in sorted(set(self.replicas) | self._starting):
            replica = self.replicas.get(index)
            if replica is None:
                states.append({"replica": index, "state": "starting"})
                continue
            stats = replica.stats
            states.append({
                "replica": index, "state": "draining" if replica.draining else "serving",
                "node_ip": replica.node_ip, "in_flight": len(replica.in_flight),
                "num_running": stats.num_running if stats else 0,
                "num_waiting": stats.num_waiting if stats else 0,
                "kv_cache_usage": stats.kv_cache_usage if stats else 0.0,
                "num_routed": replica.num_routed,
            })
        return states

    # ---- the channel ------------------------------------------------------------------

    def _send_frame(self, replica: _Replica, frame: bytes) -> None:
        replica.unsent.append(frame)
        self._flush(replica)

    @staticmethod
    def _flush(replica: _Replica) -> None:
        send_pending(replica.input, replica.unsent)

    def _housekeeping(self) -> None:
        """Between reads: resend, heal dead replicas, adopt new ones, retire drained ones."""
        while not self._deaths.empty():
            self._on_replica_death(*self._deaths.get())
        while not self._started.empty():
            self._on_replica_started(*self._started.get())
        if self._homeless and any(not r.draining for r in self.replicas.values()):
            homeless, self._homeless = self._homeless, []
            for request in homeless:
                self._resubmit(request.request_id)
        for replica in self.replicas.values():
            self._flush(replica)
        self._kill_hung_replicas()
        self._retire_drained()
        if not self.replicas and not self._starting and self.dead_error is None:
            self.dead_error = EngineDeadError("every data-parallel replica is gone and none can be restarted "
                                              f"(max_restarts {self.restart_budget.max_restarts})")
        if self.dead_error is not None:
            raise self.dead_error

    def _kill_hung_replicas(self) -> None:
        """A replica that sent nothing for longer than the step deadline while
        it holds requests is hung (one whose model runs in the replica's own
        process, the uni backend, has nobody else to notice): it is killed
        and handled as a death. A busy replica reports after every step."""
        timeout = self.config.fault_tolerance.execute_model_timeout_s
        now = time.monotonic()
        for replica in list(self.replicas.values()):
            silent_s = now - replica.last_heard
            # A rebuild (announced) may take as long as a start: it loads the model again.
            limit = self.config.fault_tolerance.engine_start_timeout_s if replica.rebuilding else timeout
            if not replica.in_flight or silent_s <= limit:
                continue
            replica.last_heard = now  # once: its death is on the way
            logger.error("data-parallel replica %d sent nothing for %.0f s with %d request(s) in flight: killing it",
                         replica.index, silent_s, len(replica.in_flight))
            self._deaths.put((replica.index, f"no progress for {silent_s:.0f} s with requests in flight (hung)"))
            self.manager.stop_replica(replica.index, wait_s=0)

    def _on_replica_death(self, index: int, cause: str) -> None:
        replica = self.replicas.pop(index, None)
        if replica is None:
            return
        self._close_channel(replica)
        orphans = sorted(replica.in_flight)
        blamed = self._charge_replica_death(index, orphans, cause)
        orphans = [rid for rid in orphans if rid in self._sent]
        logger.error("data-parallel replica %d died (%s); resubmitting its %d request(s) to the others",
                     index, cause, len(orphans))
        for rid in orphans:
            self._resubmit(rid)
        self._recoveries.append(RecoveryStats("dp_replica", 0.0, len(orphans)))
        for waiting in self._pings.values():
            waiting.discard(index)
        hunting = self.restart_budget.max_restarts > 0 and any(s.request.quarantined for s in self._sent.values())
        allowed = self.restart_budget.allow() or (hunting and self.blame.excuse())
        if blamed:  # the culprit's doing, this death included: not the replica's
            allowed = self.blame.forgive(blamed) or allowed
        if allowed:
            self._replace_in_background(index)
        else:
            logger.error("no restart left for replica %d (max_restarts %d): serving with %d replica(s)",
                         index, self.restart_budget.max_restarts, len(self.replicas))

    def _on_replica_started(self, channel: _Replica, error: BaseException | None, seconds: float) -> None:
        self._starting.discard(channel.index)
        if error is not None:
            self._close_channel(channel)
            logger.error("replacing data-parallel replica %d failed: %s", channel.index, error)
            if self.restart_budget.allow():
                self._replace_in_background(channel.index)
            return
        self.replicas[channel.index] = channel
        logger.warning("data-parallel replica %d replaced in %.1f s", channel.index, seconds)

    def _charge_replica_death(self, index: int, orphans: list[str], cause: str) -> int:
        """Charge the requests exposed to a replica's death (see
        quarantine.charge_death); a culprit ends here, with an error. Returns
        the deaths the culprit caused (0 if this one names none)."""
        record = self._running_alone(index)
        running_alone = record.read()
        record.delete()
        verdict = quarantine.charge_death({rid: self._sent[rid].request for rid in orphans}, running_alone)
        if not verdict.found_culprit:
            return 0
        culprit = verdict.culprits[0]
        logger.error("request %s was present at %d failures and killed replica %d again running alone: failed, "
                     "not retried", culprit, verdict.culprit_recoveries + 1, index)
        del self._sent[culprit]
        self._culprit_outputs.append(quarantine.culprit_output(verdict, cause))
        return verdict.culprit_recoveries + 1

    def _resubmit(self, request_id: str) -> None:
        """Send a request again, after the tokens it already produced."""
        sent = self._sent.get(request_id)
        if sent is None:
            return
        first = sent.request
        request = Request(first.request_id, first.prompt_token_ids, first.sampling_params, first.eos_token_id,
                          first.arrival_time, output_token_ids=sent.token_ids, num_recoveries=first.num_recoveries,
                          quarantined=first.quarantined, cache_salt=first.cache_salt)
        replica = self._route(request, None)
        if replica is None:
            sent.replica = -1
            self._homeless.append(request)
            return
        self._dispatch(replica, request_id, self._encoder.encode(EngineCoreRequest.from_request(request)))

    def _receive(self, frame: zmq.Frame) -> EngineCoreOutputs | None:
        """Bookkeeping for one replica message; what to pass up (None: nothing)."""
        decoded = self._decode_outputs(frame)
        if decoded is None:
            return None
        replica, outputs = decoded
        replica.last_heard = time.monotonic()
        replica.rebuilding = outputs.rebuilding
        self._drop_foreign_outputs(replica, outputs)
        if outputs.error is not None:
            # That replica is dead for good; the others serve its requests.
            self._deaths.put((outputs.engine_index, outputs.error.strip().splitlines()[-1]))
            self.manager.stop_replica(outputs.engine_index, wait_s=0)
            return None
        for recovery in outputs.recoveries:  # the replica's own: mirror its verdicts
            quarantine.mirror({rid: self._sent[rid].request for rid in replica.in_flight if rid in self._sent},
                              recovery.charged, recovery.culprits)
        if outputs.stats is not None:
            replica.stats = outputs.stats
            outputs.stats = self._aggregate_stats()
        for out in outputs.outputs:
            sent = self._sent[out.request_id]
            sent.token_ids.extend(out.new_token_ids)
            if out.finished:
                replica.in_flight.discard(out.request_id)
                del self._sent[out.request_id]
        if outputs.pong is not None:
            waiting = self._pings.get(outputs.pong)
            if waiting is not None:
                waiting.discard(replica.index)
            if waiting:  # others still to answer
                outputs.pong = None
            else:
                self._pings.pop(outputs.pong, None)
        outputs.recoveries = outputs.recoveries + self._recoveries
        self._recoveries = []
        return outputs

    def _aggregate_stats(self) -> SchedulerStats:
        stats = [r.stats for r in self.replicas.values() if r.stats is not None]
        n = max(1, len(stats))
        return SchedulerStats(
            num_running=sum(s.num_running for s in stats),
            num_waiting=sum(s.num_waiting for s in stats),
            kv_cache_usage=sum(s.kv_cache_usage for s in stats) / n,
            prefix_cache_hit_rate=sum(s.prefix_cache_hit_rate for s in stats) / n,
            prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
            num_preemptions=sum(s.num_preemptions for s in stats),
        )

    def _pending_recoveries(self) -> EngineCoreOutputs | None:
        if not self._recoveries and not self._culprit_outputs:
            return None
        outputs = EngineCoreOutputs(outputs=self._culprit_outputs, recoveries=self._recoveries)
        self._recoveries, self._culprit_outputs = [], []
        return outputs

    def shutdown(self) -> None:
        """Idempotent: replicas stopped, actors and placement groups removed."""
        self._finalizer()


class AsyncDPClient(DPClient):
    """For AsyncLLM: `get_output` awaits the output socket."""

    asyncio_mode = True

    async def scale_async(self, data_parallel_size: int) -> None:
        """`scale` without blocking the event loop while replicas load."""
        import asyncio

        new = self._plan_scale(data_parallel_size)
        if new:
            channels, targets = self._new_channels(new)
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._wait_started, channels, targets)
            except BaseException:
                for channel in channels:
                    self._close_channel(channel)
                raise
            self._adopt(channels)
        logger.info("data parallel size is now %d", data_parallel_size)

    async def get_output(self) -> EngineCoreOutputs:
        while True:
            self._housekeeping()
            pending = self._pending_recoveries()
            if pending is not None:
                return pending
            if await self._output.poll(_POLL_MS):
                outputs = self._receive(await self._output.recv(copy=False))
                if outputs is not None:
                    return outputs


class SyncDPClient(DPClient):
    """For LLMEngine (offline): `get_output` blocks on the output socket, and
    returns an empty message when nothing is in flight."""

    def get_output(self) -> EngineCoreOutputs:
        while True:
            self._housekeeping()
            pending = self._pending_recoveries()
            if pending is not None:
                return pending
            if not self._sent:
                return EngineCoreOutputs()
            if self._output.poll(_POLL_MS):
                outputs = self._receive(self._output.recv(copy=False))
                if outputs is not None:
                    return outputs

    def stats(self) -> dict:
        return msgspec.structs.asdict(self._aggregate_stats())


# Bounds the Ray calls of shutdown: when a signal to the whole process group
# took the local Ray down too, they would otherwise retry for a minute. Past
# it, Ray ends what is left: actors die with their owner (this process), and
# placement groups with the job.
_MANAGER_SHUTDOWN_DEADLINE_S = 5.0
# Within that deadline, how long the replicas may take to leave their loops
# before they are killed: the kills and the placement groups' removal must fit
# in the rest, or a slow exit (a loaded machine) would leave them to Ray.
_REPLICA_GRACE_S = 3.0


def _shutdown(manager: CoreEngineActorManager, replicas: dict, output, curve: CurveServer, ctx) -> None:
    encoder = msgspec.msgpack.Encoder()
    for replica in replicas.values():
        try:
            replica.input.send(encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    stopper = threading.Thread(target=manager.shutdown, kwargs={"grace_s": _REPLICA_GRACE_S},
                               name="raylm-dp-shutdown", daemon=True)
    stopper.start()
    stopper.join(_MANAGER_SHUTDOWN_DEADLINE_S)
    if stopper.is_alive():
        logger.warning("stopping the data-parallel replicas took over %.0f s; leaving it to Ray",
                       _MANAGER_SHUTDOWN_DEADLINE_S)
    for replica in replicas.values():
        replica.input.close(linger=0)
    replicas.clear()
    output.close(linger=0)
    curve.stop()
    for sock in list(ctx._sockets):  # any socket still open (pyzmq's own list, as Context.destroy uses it)
        sock.close(linger=0)
    terminate_context(ctx)  # bounded: a stranger's pending handshake must not hang shutdown
