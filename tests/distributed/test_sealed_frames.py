"""The seal on a K/V transfer between nodes (raylm.distributed.sealed_frames):
only a holder of the key makes a request that opens, an answer's messages
open only for the request they answer and with the header they were sealed
with, and a change to any byte is caught."""

from __future__ import annotations

import pytest

from raylm.distributed import sealed_frames
from raylm.distributed.sealed_frames import AnswerSeal, SealBroken, TransferKey


def test_a_request_opens_with_its_key_only_and_both_ends_get_the_same_answer_seal():
    key = TransferKey(sealed_frames.new_key())
    request, asked = key.seal_request(b"m-1-0.rank0")
    body, answering = key.open_request(request)
    assert body == b"m-1-0.rank0"
    sealed = answering.seal(3, b"ok-header", b"the blocks")
    assert asked.open(3, b"ok-header", sealed) == b"the blocks"
    with pytest.raises(SealBroken):
        TransferKey(sealed_frames.new_key()).open_request(request)
    changed = bytearray(request)
    changed[-1] ^= 1
    with pytest.raises(SealBroken):
        key.open_request(bytes(changed))
    with pytest.raises(SealBroken):
        key.open_request(b"m-1-0.rank0")  # a name in the clear is no request


@pytest.mark.parametrize("change", ["index", "header", "byte", "another request"])
def test_an_answer_opens_only_as_it_was_sealed(change):
    key = TransferKey(sealed_frames.new_key())
    request, asked = key.seal_request(b"name")
    _, answering = key.open_request(request)
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
