"""The seal on a K/V transfer between nodes (raylm.kv_transfer.sealed_frames):
only a holder of the key makes a request or an admission token that opens,
a receiver takes each once and only within its lifetime, an answer's
messages open only for the request they answer and with the header they
were sealed with, and a change to any byte is caught."""

from __future__ import annotations

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from raylm.kv_transfer import sealed_frames
from raylm.kv_transfer.sealed_frames import AnswerSeal, Replayed, SealBroken, SeenRequests, TransferKey


def test_a_request_opens_with_its_key_only_and_both_ends_get_the_same_answer_seal():
    key = TransferKey(sealed_frames.new_key())
    request, asked = key.seal_request(b"m-1-0.rank0")
    body, answering = key.open_request(request, SeenRequests())
    assert body == b"m-1-0.rank0"
    sealed = answering.seal(3, b"ok-header", b"the blocks")
    assert asked.open(3, b"ok-header", sealed) == b"the blocks"
    with pytest.raises(SealBroken):
        TransferKey(sealed_frames.new_key()).open_request(request, SeenRequests())
    changed = bytearray(request)
    changed[-1] ^= 1
    with pytest.raises(SealBroken):
        key.open_request(bytes(changed), SeenRequests())
    with pytest.raises(SealBroken):
        key.open_request(b"m-1-0.rank0", SeenRequests())  # a name in the clear is no request


@pytest.mark.parametrize("change", ["index", "header", "byte", "another request"])
def test_an_answer_opens_only_as_it_was_sealed(change):
    key = TransferKey(sealed_frames.new_key())
    request, asked = key.seal_request(b"name")
    _, answering = key.open_request(request, SeenRequests())
    data = bytes(range(256)) * 8
    sealed = bytearray(AnswerSeal.sealed_size(len(data)))
    answering.seal_into(5, b"ok\x05", data, sealed)
    index, header, seal = 5, b"ok\x05", asked
    if change == "index":
        index = 6
    elif change == "header":
        header = b"ok\x06"
    elif change == "byte":
        sealed[len(data) // 2] ^= 0x80
    else:
        _, seal = key.seal_request(b"name")  # the same name asked again: another answer's seal
    out = bytearray(len(data))
    with pytest.raises(SealBroken):
        seal.open_into(index, header, sealed, out)
    # Unchanged, it opens into the buffer exactly.
    if change != "byte":
        asked.open_into(5, b"ok\x05", sealed, out)
        assert bytes(out) == data


def test_each_request_gets_an_answer_seal_of_its_own():
    """The same message index sealed for two requests differs: an answer's
    nonces count from 0 without one ever repeating under a key."""
    key = TransferKey(sealed_frames.new_key())
    seals = [key.seal_request(b"name")[1] for _ in range(2)]
    assert seals[0].seal(0, b"", b"x" * 64) != seals[1].seal(0, b"", b"x" * 64)


def test_a_key_is_32_bytes_and_stays_out_of_its_repr():
    raw = sealed_frames.new_key()
    assert len(raw) == 32 and raw != sealed_frames.new_key()
    assert raw.hex() not in repr(TransferKey(raw)) and str(raw) not in repr(TransferKey(raw))
    assert TransferKey(raw) == TransferKey(raw) and TransferKey(raw) != TransferKey(sealed_frames.new_key())
    for bad in (b"short", raw + b"x", "text" * 8):
        with pytest.raises(ValueError, match="32 bytes"):
            TransferKey(bad)


def test_a_request_is_taken_once_so_no_answer_key_seals_twice():
    """A request played back after its answer (a 'failed' one, say) gets
    none: a second answer would be sealed under the same key and the same
    nonces (a status message's index) as the first."""
    key, seen = TransferKey(sealed_frames.new_key()), SeenRequests()
    request, _ = key.seal_request(b"m-1.rank0")
    _, answering = key.open_request(request, seen)
    answering.seal(sealed_frames.MAX_ANSWER_MESSAGES, b"failed", b"why")
    with pytest.raises(Replayed, match="taken before"):
        key.open_request(request, seen)
    # Another receiver (another server, another key's) keeps its own.
    assert key.open_request(request, SeenRequests())[0] == b"m-1.rank0"


def test_a_request_out_of_its_lifetime_is_refused_and_one_is_remembered_no_longer():
    clock = {"wall": 1_000_000.0, "monotonic": 50.0}
    seen = SeenRequests(lifetime_s=60, wall=lambda: clock["wall"], monotonic=lambda: clock["monotonic"])
    key = TransferKey(sealed_frames.new_key())
    request, _ = key.seal_request(b"name")  # sealed now, by the real clock
    sealed_at = sealed_frames._SEALED_AT.unpack_from(
        AESGCM(sealed_frames._sub_key(key._key, sealed_frames._REQUEST_INFO)).decrypt(
            request[:12], request[12:], sealed_frames._REQUEST_AAD
        )
    )[0]
    clock["wall"] = sealed_at + 61  # played back a minute later, or the hosts' clocks a minute apart
    with pytest.raises(Replayed, match="lifetime") as refused:
        key.open_request(request, seen)
    assert refused.value.reason == "stale"
    clock["wall"] = sealed_at - 61
    with pytest.raises(Replayed, match="lifetime"):
        key.open_request(request, seen)
    clock["wall"] = sealed_at + 59
    key.open_request(request, seen)
    assert len(seen) == 1
    clock["monotonic"] += 119  # still remembered while a copy could be within its lifetime
    with pytest.raises(Replayed, match="taken before"):
        key.open_request(request, seen)
    clock["monotonic"] += 2
    seen.take(b"another nonce", clock["wall"])
    assert len(seen) == 1  # the first forgotten (by then the wall clock refuses it)


def test_a_receiver_that_remembers_its_limit_refuses_more_rather_than_forget():
    key, seen = TransferKey(sealed_frames.new_key()), SeenRequests(limit=3)
    for _ in range(3):
        key.open_request(key.seal_request(b"name")[0], seen)
    with pytest.raises(Replayed, match="more than 3"):
        key.open_request(key.seal_request(b"name")[0], seen)


def test_an_admission_token_admits_once_and_is_no_request():
    key, seen = TransferKey(sealed_frames.new_key()), SeenRequests()
    token = key.admission_token()
    assert len(token) <= 255  # ZMQ PLAIN's password
    key.admit(token, seen)
    with pytest.raises(Replayed):
        key.admit(token, seen)
    with pytest.raises(SealBroken):
        TransferKey(sealed_frames.new_key()).admit(key.admission_token(), seen)
    # Sealed for another use, neither passes for the other.
    with pytest.raises(SealBroken):
        key.open_request(key.admission_token(), seen)
    with pytest.raises(SealBroken):
        key.admit(key.seal_request(b"")[0], seen)
    assert len(seen) == 1  # what did not open was not remembered


def test_the_transfer_key_itself_seals_nothing():
    """Requests go under a sub-key of their own, each answer under its own:
    the transfer key's AES-GCM does not open a request, and a request's
    sub-key does not open an answer's message."""
    raw = sealed_frames.new_key()
    key = TransferKey(raw)
    request, asked = key.seal_request(b"name")
    with pytest.raises(InvalidTag):
        AESGCM(raw).decrypt(request[:12], request[12:], sealed_frames._REQUEST_AAD)
    sealed = asked.seal(0, b"", b"x" * 16)
    with pytest.raises(SealBroken):
        AnswerSeal(sealed_frames._sub_key(raw, sealed_frames._REQUEST_INFO)).open(0, b"", sealed)
