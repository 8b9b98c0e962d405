"""Engine cores as data-parallel replicas on Ray (docs/architecture.md, "Data
parallel and the supervisor"): placed, started, watched and stopped by
dp_manager.CoreEngineActorManager, talked to over ZMQ/msgpack exactly like a local core process, on TCP.

Trust. Every channel is ZMQ CURVE: each replica has a keypair of its own
(through Ray, never a socket), and the supervisor admits on a replica's input
socket that replica's key only, and on the output socket its replicas' keys
only, so no other process can take requests or inject outputs. The output
socket tells from the key which replica sent a frame (`sender`), and a
replica may not sign as another.
"""

from __future__ import annotations

import logging
import os
import threading

import zmq

from raylm.config import EngineConfig
from raylm.distributed.tcp_auth import CurveKeys, CurveServer
from raylm.engine.core_channel import CoreChannel, CoreLauncher, DropLog
from raylm.engine.dp_manager import CoreEngineActorManager, ReplicaChannel, RunningAloneRecordInRay
from raylm.engine.protocol import EngineCoreOutputs, RecoveryKind

logger = logging.getLogger(__name__)

# The ZAP domain of the output socket (each input socket has its replica's).
_OUTPUT_DOMAIN = "raylm-dp-output"
# Bounds the Ray calls of shutdown: when a signal to the whole process group
# took the local Ray down too, they would otherwise retry for a minute. Past
# it, Ray ends what is left: actors die with their owner (this process), and
# placement groups with the job.
_MANAGER_SHUTDOWN_DEADLINE_S = 5.0
# Within that deadline, how long the replicas may take to leave their loops
# before they are killed: the kills and the placement groups' removal must fit
# in the rest, or a slow exit (a loaded machine) would leave them to Ray.
_REPLICA_GRACE_S = 3.0


def _input_domain(index: int) -> str:
    return f"raylm-dp-input-{index}"


class _ReplicaKeys:
    """The replicas' public keys that the supervisor's sockets admit, shared
    with the ZAP thread (single dict reads and writes, atomic in Python).
    Only live channels are here: a replaced replica's key stops working."""

    def __init__(self):
        self.channels: dict[bytes, tuple[CoreChannel, CurveKeys]] = {}

    def admits(self, domain: str, client_key: bytes) -> bool:
        entry = self.channels.get(client_key)
        return entry is not None and domain in (_OUTPUT_DOMAIN, _input_domain(entry[0].index))


class RayReplicaLauncher(CoreLauncher):
    recovery_kind = RecoveryKind.DP_REPLICA
    can_scale = True

    def __init__(self, config: EngineConfig):
        self.config = config
        self._deaths: list[tuple[int, str]] = []
        self._deaths_lock = threading.Lock()
        self.manager = CoreEngineActorManager(config, on_death=self._on_death)
        self._host = self._front_end_host()
        self._keys = _ReplicaKeys()
        self._channel_keys: dict[int, CurveKeys] = {}
        self.curve: CurveServer | None = None
        self.output_address = ""
        self.misattributed = DropLog("a replica message signed with another replica's index", logger)
        self._closed = False
        self._node_ips: dict[int, str] = {}  # replica index -> the node its core runs on

    def _on_death(self, index: int, cause: str) -> None:
        with self._deaths_lock:
            self._deaths.append((index, cause))

    @staticmethod
    def _front_end_host() -> str:
        """Replicas on other hosts reach us at this node's IP; on one host, loopback."""
        import ray

        ips = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        return "127.0.0.1" if len(ips) <= 1 else ray.util.get_node_ip_address()

    def bind_output(self, ctx: zmq.Context) -> zmq.Socket:
        # Made before any socket is bound: no client may connect unchecked.
        self.curve = CurveServer(ctx, CurveKeys.generate(), admits=self._keys.admits)
        socket = ctx.socket(zmq.PULL)
        self.curve.secure(socket, _OUTPUT_DOMAIN)
        port = socket.bind_to_random_port(f"tcp://{self._host}")
        self.output_address = f"tcp://{self._host}:{port}"
        return socket

    def new_channel(self, ctx: zmq.Context, index: int) -> CoreChannel:
        """A replica's input socket and keypair; its key is admitted from now
        until `close_channel` (the replica connects while it starts)."""
        socket = ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        self.curve.secure(socket, _input_domain(index))
        port = socket.bind_to_random_port(f"tcp://{self._host}")
        channel = CoreChannel(index, socket, f"tcp://{self._host}:{port}")
        keys = CurveKeys.generate()
        self._keys.channels[keys.public] = (channel, keys)
        self._channel_keys[id(channel)] = keys
        return channel

    def keys_of(self, channel: CoreChannel) -> CurveKeys:
        return self._channel_keys[id(channel)]

    def close_channel(self, channel: CoreChannel) -> None:
        keys = self._channel_keys.pop(id(channel), None)
        if keys is not None:
            self._keys.channels.pop(keys.public, None)
        channel.input.close(linger=0)

    def sender(
        self, frame: zmq.Frame, outputs: EngineCoreOutputs, channels: dict[int, CoreChannel]
    ) -> CoreChannel | None:
        """The serving replica whose key sent `frame` (CURVE tells the key):
        None for a replica given up on (what it sent before is still
        arriving) or not yet adopted, and for one signing as another."""
        entry = self._keys.channels.get(frame.get("User-Id").encode())
        if entry is None or channels.get(entry[0].index) is not entry[0]:
            logger.debug("dropped a message from a data-parallel replica no longer (or not yet) serving")
            return None
        channel = entry[0]
        if outputs.engine_index != channel.index:
            self.misattributed.dropped(f"replica {channel.index} signed as replica {outputs.engine_index}")
            return None
        return channel

    def _running_alone(self, index: int) -> RunningAloneRecordInRay:
        """Replica `index`'s record of the quarantined request it runs alone."""
        return RunningAloneRecordInRay(f"raylm-running-alone-{id(self):x}-{os.getpid()}-{index}")

    def plan_targets(self, num_cores: int) -> list:
        return self.manager.plan_nodes(num_cores)

    def start(self, channel: CoreChannel, target) -> None:
        replica = ReplicaChannel(
            channel.address,
            self.output_address,
            self.keys_of(channel),
            self.curve.keys.public,
            self._running_alone(channel.index).key.decode(),
        )
        handle = self.manager.start_replica(
            channel.index, replica, target, config=self.core_config(self.manager.config, channel.index)
        )
        channel.node_ip = handle.node_ip
        self._node_ips[channel.index] = handle.node_ip

    def stop(self, index: int, wait_s: float) -> None:
        self.manager.stop_replica(index, wait_s=wait_s)

    def deaths(self) -> list[tuple[int, str]]:
        with self._deaths_lock:
            found, self._deaths = self._deaths, []
        return found

    def is_local(self, index: int) -> bool:
        # The replica's core runs on this node; its workers are placed with it
        # when they fit (a transfer from a worker elsewhere fails, and the
        # migration is abandoned with the request still at its source).
        import ray

        return self._node_ips.get(index) in (ray.util.get_node_ip_address(), "127.0.0.1")

    def take_running_alone(self, index: int) -> str | None:
        record = self._running_alone(index)
        request_id = record.read()
        record.delete()
        return request_id

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        stopper = threading.Thread(
            target=self.manager.shutdown, kwargs={"grace_s": _REPLICA_GRACE_S}, name="raylm-dp-shutdown", daemon=True
        )
        stopper.start()
        stopper.join(_MANAGER_SHUTDOWN_DEADLINE_S)
        if stopper.is_alive():
            logger.warning(
                "stopping the data-parallel replicas took over %.0f s; leaving it to Ray", _MANAGER_SHUTDOWN_DEADLINE_S
            )
        if self.curve is not None:
            self.curve.stop()
