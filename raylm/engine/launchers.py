"""The two ends of the supervisor's cores: which `CoreLauncher` runs a
config's cores (`make_launcher`: Ray replicas for data parallelism on Ray,
else local core processes), and the supervisor's finalizer
(`shutdown_cores`): every core told to stop and stopped, every channel and
socket closed, the ZMQ context terminated within bounds.
"""

from __future__ import annotations

import threading

import msgspec
import zmq

from raylm.config import EngineConfig
from raylm.distributed.tcp_auth import terminate_context
from raylm.engine.core_channel import CoreLauncher
from raylm.engine.protocol import Shutdown


def make_launcher(config: EngineConfig) -> CoreLauncher:
    """Ray replicas for data parallelism on Ray, else local core processes."""
    pc = config.parallel_config
    scalable = pc.data_parallel_size > 1 or config.autoscale is not None
    if scalable and pc.data_parallel_backend == "ray":
        from raylm.engine.ray_launcher import RayReplicaLauncher

        return RayReplicaLauncher(config)
    from raylm.engine.process_launcher import ProcessCoreLauncher

    return ProcessCoreLauncher(config)


def shutdown_cores(launcher: CoreLauncher, channels: dict, output, ctx, closed: threading.Event) -> None:
    """The supervisor's finalizer: every core told to stop and stopped,
    its channels, the output socket and the context closed."""
    closed.set()  # replacements waiting out their backoff give up
    shutdown = msgspec.msgpack.encode(Shutdown())
    for channel in channels.values():
        try:
            channel.send(shutdown)  # never blocks: what a dead core cannot take is dropped below
        except zmq.ZMQError:
            pass
    launcher.shutdown()
    for channel in channels.values():
        launcher.close_channel(channel)
    channels.clear()
    output.close(linger=0)
    for sock in list(ctx._sockets):  # any socket still open (pyzmq's own list, as Context.destroy uses it)
        sock.close(linger=0)
    terminate_context(ctx)  # bounded: a stranger's pending handshake must not hang shutdown
