"""ZMQ CURVE for the step queues' TCP sockets (readers on other nodes).

One keypair per executor, made by the driver and handed to the workers through
Ray (the actor call that sets up their queues). It is a pre-shared key: every
party of the executor holds the secret half, a ZAP handler on each writer's
socket admits only clients presenting its public half, and every client
checks the server against it. A process without the secret can neither
subscribe (read the steps) nor pose as the writer (feed a reader its bytes),
and everything on the wire is encrypted.

RAYLM_MQ_UNAUTHENTICATED_TCP=1 turns it off (plain TCP, as a benchmark's
baseline); the driver decides for the whole executor.

A server may instead admit keys of its own choosing (`admits`), per ZAP
domain: the data-parallel front end gives each replica a keypair of its own,
so that it can tell which replica sent a message (see engine/ray_launcher.py).
"""

from __future__ import annotations

import hmac
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread

UNAUTHENTICATED_TCP_ENV = "RAYLM_MQ_UNAUTHENTICATED_TCP"
# A peer that has not finished the CURVE handshake this long after connecting
# is dropped (libzmq's default is 30 s). A rightful peer needs a few round
# trips; a stranger who connects and stays silent would otherwise hold one of
# the process's file descriptors for half a minute per connection.
HANDSHAKE_TIMEOUT_MS = 10_000


def tcp_auth_enabled() -> bool:
    """CURVE on cross-node queues unless RAYLM_MQ_UNAUTHENTICATED_TCP is set to 1/true/yes."""
    return os.environ.get(UNAUTHENTICATED_TCP_ENV, "").strip().lower() not in ("1", "true", "yes")


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE keypair (z85 text, as pyzmq makes them). It travels inside
    queue handles, so a handle must only be passed over trusted channels
    (Ray actor calls, a spawned child's arguments)."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeys:
        if not zmq.has("curve"):
            raise RuntimeError(
                "this pyzmq/libzmq has no CURVE support, so cross-node step queues cannot be "
                f"authenticated; install a pyzmq built with libsodium, or set {UNAUTHENTICATED_TCP_ENV}=1 "
                "to run them unauthenticated on a network you trust"
            )
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


class CurveServer:
    """The writer side: a ZAP handler on the writer's ZMQ context (a thread of
    pyzmq's) that admits the executor's own key only. Start it before binding.

    `admits(domain, client_public_key)`, when given, decides instead (keys in
    z85; it runs on the ZAP thread); `secure(sock, domain)` names the domain
    a socket's clients are checked in."""

    def __init__(self, context: zmq.Context, keys: CurveKeys, admits: Callable[[str, bytes], bool] | None = None):
        self.keys = keys
        self._admits = admits
        self._authenticator = zmq.auth.thread.ThreadAuthenticator(context)
        self._authenticator.start()
        self._authenticator.configure_curve_callback("*", credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        # pyzmq hands the client's public key in z85, like ours.
        if self._admits is not None:
            return self._admits(domain, client_key)
        return hmac.compare_digest(client_key, self.keys.public)

    def secure(self, sock: zmq.Socket, domain: str | None = None) -> None:
        if domain is not None:
            # pyzmq's handler looks a domain up by name: one it does not know
            # is refused, so each one is registered (to the same callback).
            self._authenticator.configure_curve_callback(domain, credentials_provider=self)
            sock.setsockopt_string(zmq.ZAP_DOMAIN, domain)
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)

    @property
    def thread(self):
        return self._authenticator.thread

    def stop(self) -> None:
        self._authenticator.stop()


def secure_client(sock: zmq.Socket, keys: CurveKeys, server_key: bytes | None = None) -> None:
    """The reader side, before connect: present the executor's key, and accept
    only a server that holds it too (or, given, the server's public key)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public if server_key is None else server_key


# How long closing a context that served CURVE may wait for libzmq.
_TERM_TIMEOUT_S = 5.0


def terminate_context(context: zmq.Context, timeout_s: float = _TERM_TIMEOUT_S) -> bool:
    """Terminate a context whose sockets are closed, waiting at most
    `timeout_s`; False if it was left to the process's exit instead.

    A context that served CURVE can block in zmq_ctx_term forever: a peer
    whose handshake was waiting on the ZAP handler when the handler stopped
    (a stranger knocking at the port, say) keeps its session open, and
    libzmq waits for it. Closing must not hang on what a stranger sent, so
    the termination runs on a daemon thread and is abandoned past the bound
    (its I/O thread then lives until the process exits)."""
    done = threading.Event()

    def term() -> None:
        context.term()
        done.set()

    threading.Thread(target=term, name="raylm-zmq-term", daemon=True).start()
    return done.wait(timeout_s)
