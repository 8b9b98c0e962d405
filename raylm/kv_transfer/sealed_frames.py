"""Requests and answers sealed with a pre-shared key (AES-256-GCM): the
trust of a K/V transfer between nodes (raylm.kv_transfer.network).

A party holding the key asks for something by sealing its request; the
answer's messages are sealed under a key of their own, derived from the
transfer key and the request's random nonce, so that they can number their
nonces from 0 and an answer is good only for the request it answers. A
message that fails its seal (a stranger's, or one changed on the way) is
refused.

Trust: no key+nonce pair seals two things. Requests and answers use sub-keys
of the transfer key (HKDF, each direction its own label; the transfer key
itself seals nothing), requests with random 96-bit nonces. A receiver takes
each sealed request once (`SeenRequests`): a request carries when it was
sealed, one older or newer than REQUEST_LIFETIME_S by the receiver's clock
is refused, and a younger one whose nonce it has already taken too; so a
request recorded on the wire and played back gets no second answer, whose
messages would reuse the first answer's key and nonces (a played-back
request after a 'failed' answer once got a 'missing' sealed under the same
key and nonce). The same holds for admission tokens (`admission_token`),
which a listening socket asks for at each connection's handshake before it
takes any message from it (raylm.kv_transfer.admission.SealedAdmission). What sealing cannot
stop: someone who reads the wire may race the rightful party with a copy of
its token or request; whichever comes first is taken, the other refused.

Why not ZMQ CURVE, as the step queues: CURVE (libsodium's XSalsa20-Poly1305,
on libzmq's I/O thread) cost about 0.5 ms of CPU per MiB at each end, two
thirds of what a source's copies took from the decode steps of a host with
no core to spare; AES-GCM runs at ~20 GB/s per core where the CPU has AES instructions
(benchmarks/history/migration.md, "K/V across hosts: the seal"). What CURVE adds besides,
forward secrecy, a per-connection handshake, matters less for blocks whose
key lives no longer than the supervisor that made it and travels only on the
cores' authenticated channels.
"""

from __future__ import annotations

import collections
import os
import struct
import threading
import time

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
# HKDF labels of the sub-keys: one for what the asking side seals (requests,
# admission tokens), one for each answer (salted with its request's nonce).
_REQUEST_INFO = b"raylm sealed requests"
_ANSWER_INFO = b"raylm sealed answer"
# Bound to what each seals under the request sub-key, so that neither passes for the other.
_REQUEST_AAD = b"raylm sealed request"
_ADMISSION_AAD = b"raylm admission token"
# A request's first sealed bytes: when it was sealed (seconds since the epoch).
_SEALED_AT = struct.Struct("<d")
# How far a request's time may be from its receiver's clock: the request is
# sent at once (a fetch's, when it starts), so this is mostly the hosts'
# clocks apart; it bounds how long a receiver remembers the request.
REQUEST_LIFETIME_S = 60.0
# The most requests a receiver remembers (their nonces, 12 bytes each): a
# receiver that has taken this many within 2 x REQUEST_LIFETIME_S refuses
# more until the oldest are forgotten, rather than forget one that could
# still be played back. Only holders of the key can fill it (a request
# is remembered once it opens); a migration takes two per stage and rank
# (the admission and the request).
MAX_REMEMBERED = 16384
# An answer's nonces: its messages' indices (a 96-bit nonce, 32 bits used).
_NONCE = struct.Struct("<I8x")
MAX_ANSWER_MESSAGES = (1 << 32) - 1


class SealBroken(Exception):
    """A message that its key does not open: not sealed with it, or changed since."""


class Replayed(SealBroken):
    """A sealed request (or token) that opens but is not taken; `reason`:
    'replayed' (taken before), 'stale' (out of its lifetime: played back
    later, or the hosts' clocks apart) or 'too many' (more than its
    receiver remembers)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def _sub_key(key: bytes, info: bytes, salt: bytes | None = None) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=info).derive(key)


class SeenRequests:
    """The sealed requests a receiver has taken, so that it takes each once:
    a request is taken if it was sealed within `lifetime_s` of `wall()`
    and its nonce is not remembered; its nonce is then remembered for
    2 x `lifetime_s` (by `monotonic()`), after which a copy of it is out of
    its lifetime anyway (unless the wall clock is set back meanwhile by more
    than `lifetime_s`). Thread-safe: a server's admission and its requests
    share one."""

    def __init__(
        self,
        lifetime_s: float = REQUEST_LIFETIME_S,
        limit: int = MAX_REMEMBERED,
        wall=time.time,
        monotonic=time.monotonic,
    ):
        self.lifetime_s, self.limit = lifetime_s, limit
        self._wall, self._monotonic = wall, monotonic
        self._lock = threading.Lock()
        self._nonces: set[bytes] = set()
        self._order: collections.deque[tuple[float, bytes]] = collections.deque()  # (forget at, nonce)

    def take(self, nonce: bytes, sealed_at: float) -> None:
        """Take the request of `nonce`, sealed at `sealed_at`; Replayed if it may not be."""
        if abs(self._wall() - sealed_at) > self.lifetime_s:
            raise Replayed("a sealed request out of its lifetime (played back, or the hosts' clocks differ)", "stale")
        now = self._monotonic()
        with self._lock:
            while self._order and self._order[0][0] <= now:
                self._nonces.discard(self._order.popleft()[1])
            if nonce in self._nonces:
                raise Replayed("a sealed request taken before (played back)", "replayed")
            if len(self._nonces) >= self.limit:
                raise Replayed(f"more than {self.limit} sealed requests within {2 * self.lifetime_s:.0f} s", "too many")
            self._nonces.add(nonce)
            self._order.append((now + 2 * self.lifetime_s, nonce))

    def __len__(self) -> int:
        with self._lock:
            return len(self._nonces)


class TransferKey:
    """The pre-shared key: seals and opens requests and admission tokens, and
    derives each answer's key."""

    def __init__(self, key: bytes):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"a transfer key is {KEY_BYTES} bytes")
        self._key = key
        self._requests = AESGCM(_sub_key(key, _REQUEST_INFO))

    def __eq__(self, other) -> bool:
        return isinstance(other, TransferKey) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return "TransferKey(...)"  # the key itself stays out of logs

    def seal_request(self, body: bytes) -> tuple[bytes, AnswerSeal]:
        """The request to send, and the seal its answer will come under."""
        nonce, request = self._seal(body, _REQUEST_AAD)
        return request, self._answer_seal(nonce)

    def open_request(self, request: bytes, seen: SeenRequests) -> tuple[bytes, AnswerSeal]:
        """The body of a request and the seal to answer it under; SealBroken
        if it was not sealed with this key, Replayed if `seen` does not take it."""
        body = self._open(request, _REQUEST_AAD, seen)
        return body, self._answer_seal(request[:NONCE_BYTES])

    def admission_token(self) -> bytes:
        """A token that admits its bearer's connection once (36 bytes:
        within ZMQ PLAIN's 255-byte password)."""
        return self._seal(b"", _ADMISSION_AAD)[1]

    def admit(self, token: bytes, seen: SeenRequests) -> None:
        """SealBroken if `token` was not made with this key, Replayed if `seen` does not take it."""
        self._open(token, _ADMISSION_AAD, seen)

    def _seal(self, body: bytes, aad: bytes) -> tuple[bytes, bytes]:
        nonce = os.urandom(NONCE_BYTES)  # random: requests are few, so 96 bits never repeat in practice
        return nonce, nonce + self._requests.encrypt(nonce, _SEALED_AT.pack(time.time()) + body, aad)

    def _open(self, sealed: bytes, aad: bytes, seen: SeenRequests) -> bytes:
        if len(sealed) < NONCE_BYTES + _SEALED_AT.size + TAG_BYTES:
            raise SealBroken("too short to be sealed with the transfer key")
        nonce = sealed[:NONCE_BYTES]
        try:
            plain = self._requests.decrypt(nonce, sealed[NONCE_BYTES:], aad)
        except InvalidTag:
            raise SealBroken("not sealed with the transfer key") from None
        # Only now, sealed with the key: a stranger's junk fills nothing.
        seen.take(nonce, _SEALED_AT.unpack_from(plain)[0])
        return plain[_SEALED_AT.size :]

    def _answer_seal(self, request_nonce: bytes) -> AnswerSeal:
        return AnswerSeal(_sub_key(self._key, _ANSWER_INFO, salt=request_nonce))


class AnswerSeal:
    """Seals and opens the messages of one answer: message `index`'s nonce
    is its index, so each index is sealed once. `header`: bytes that travel
    in the clear beside the sealed ones (a status, an index), bound to them."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)

    @staticmethod
    def sealed_size(size: int) -> int:
        return size + TAG_BYTES

    def seal_into(self, index: int, header: bytes, data, out) -> None:
        """Seal `data` into `out` (writable, exactly `sealed_size(len(data))` bytes)."""
        self._aead.encrypt_into(_nonce(index), data, header, out)

    def seal(self, index: int, header: bytes, data: bytes) -> bytes:
        return self._aead.encrypt(_nonce(index), data, header)

    def open_into(self, index: int, header: bytes, sealed, out) -> None:
        """Open `sealed` into `out` (exactly its size less the tag); SealBroken
        if it does not open (what `out` then holds must not be used)."""
        try:
            self._aead.decrypt_into(_nonce(index), sealed, header, out)
        except InvalidTag:
            raise SealBroken("a message not sealed for this answer") from None

    def open(self, index: int, header: bytes, sealed) -> bytes:
        try:
            return self._aead.decrypt(_nonce(index), sealed, header)
        except InvalidTag:
            raise SealBroken("a message not sealed for this answer") from None


def _nonce(index: int) -> bytes:
    if not 0 <= index <= MAX_ANSWER_MESSAGES:
        raise ValueError(f"an answer has at most {MAX_ANSWER_MESSAGES} messages")
    return _NONCE.pack(index)
