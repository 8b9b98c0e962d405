"""Requests and answers sealed with a pre-shared key (AES-256-GCM): the
trust of a K/V transfer between nodes (raylm.worker.kv_network).

A party holding the key asks for something by sealing its request; the
answer's messages are sealed under a key of their own, derived from the
transfer key and the request's random nonce, so that they can number their
nonces from 0 without one ever being used twice under one key, and so that
an answer is good only for the request it answers. A message that fails its
seal (a stranger's, or one changed on the way) is refused.

Why not ZMQ CURVE, as the step queues: CURVE (libsodium's XSalsa20-Poly1305,
on libzmq's I/O thread) cost about 0.5 ms of CPU per MiB at each end, two
thirds of what a source's copies took from the decode steps of a host with
no core to spare; AES-GCM runs at ~20 GB/s per core where the CPU has AES instructions
(benchmarks/README, "K/V across hosts: the seal"). What CURVE adds besides,
forward secrecy, a per-connection handshake, matters less for blocks whose
key lives no longer than the supervisor that made it and travels only on the
cores' authenticated channels.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
_REQUEST_AAD = b"raylm sealed request"
_ANSWER_INFO = b"raylm sealed answer"
# An answer's nonces: its messages' indices (a 96-bit nonce, 32 bits used).
_NONCE = struct.Struct("<I8x")
MAX_ANSWER_MESSAGES = (1 << 32) - 1


class SealBroken(Exception):
    """A message that its key does not open: not sealed with it, or changed since."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


class TransferKey:
    """The pre-shared key: seals and opens requests, and derives each answer's key."""

    def __init__(self, key: bytes):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"a transfer key is {KEY_BYTES} bytes")
        self._key = key
        self._aead = AESGCM(key)

    def __eq__(self, other) -> bool:
        return isinstance(other, TransferKey) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return "TransferKey(...)"  # the key itself stays out of logs

    def seal_request(self, body: bytes) -> tuple[bytes, "AnswerSeal"]:
        """The request to send, and the seal its answer will come under."""
        nonce = os.urandom(NONCE_BYTES)  # random: requests are few, so 96 bits never repeat in practice
        return nonce + self._aead.encrypt(nonce, body, _REQUEST_AAD), self._answer_seal(nonce)

    def open_request(self, request: bytes) -> tuple[bytes, "AnswerSeal"]:
        """The body of a request and the seal to answer it under; SealBroken
        if it was not sealed with this key."""
        if len(request) < NONCE_BYTES + TAG_BYTES:
            raise SealBroken("too short to be a sealed request")
        nonce = request[:NONCE_BYTES]
        try:
            body = self._aead.decrypt(nonce, request[NONCE_BYTES:], _REQUEST_AAD)
        except InvalidTag:
            raise SealBroken("a request not sealed with the transfer key") from None
        return body, self._answer_seal(nonce)

    def _answer_seal(self, request_nonce: bytes) -> "AnswerSeal":
        key = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=request_nonce, info=_ANSWER_INFO).derive(self._key)
        return AnswerSeal(key)


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
