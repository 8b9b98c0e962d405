"""The step queues' codec: every declared message type round-trips with its
types intact (property-based, against the object itself as the oracle); a
value of an undeclared type fails at encode time naming it, and so does an
int past 64 bits (UnencodableValueError, naming where it sits); code (a
pickled callable) is refused unless the bytes come from a trusted local ring."""

from __future__ import annotations

import dataclasses
import pickle
import re

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from raylm.distributed.message_codec import (
    DEFAULT_MESSAGE_TYPES,
    DEFAULT_RECORD_TYPES,
    CallableNotAllowedError,
    MessageCodec,
    UndeclaredTypeError,
    UnencodableValueError,
    UntrustedPayloadError,
)
from raylm.distributed.rpc_messages import CallableRef, RemoteError, RpcReply, RpcRequest
from raylm.messages import (
    CachedRequestData,
    GrammarOutput,
    KVCacheConfig,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from raylm.sampling_params import SamplingParams, StructuredOutputsParams

CODEC = MessageCodec()

ids = st.integers(min_value=0, max_value=2**31 - 1)
token_lists = st.lists(ids, max_size=20)
names = st.text(max_size=12)
# msgpack carries ints in [-2**63, 2**64 - 1]; values just past it must be refused clearly.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
any_ints = st.integers() | st.sampled_from([_INT_MIN - 1, _INT_MIN, _INT_MAX, _INT_MAX + 1, -(2**100)])
floats = st.floats(allow_nan=False, allow_infinity=False, width=64)

structured = st.one_of(
    st.none(),
    st.builds(StructuredOutputsParams, regex=st.text(min_size=1, max_size=10)),
    st.builds(StructuredOutputsParams, choice=st.lists(names, min_size=1, max_size=3)),
    st.builds(
        StructuredOutputsParams,
        json=st.dictionaries(names, any_ints | names, max_size=3),
        disable_any_whitespace=st.booleans(),
    ),
)
sampling_params = st.builds(
    SamplingParams,
    n=st.integers(1, 4),
    temperature=st.floats(0.0, 2.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.sampled_from([-1, 1, 50]),
    seed=st.none() | ids,
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    stop_token_ids=token_lists,
    max_tokens=st.none() | st.integers(1, 4096),
    logprobs=st.none() | st.integers(0, 20),
    prompt_logprobs=st.none() | st.integers(0, 20),
    structured_outputs=structured,
    # Helper fields added alongside this codec: plain types, carried as they are.
    logit_bias=st.none() | st.dictionaries(ids, st.floats(-100, 100), min_size=1, max_size=4),
    allowed_token_ids=st.none() | st.lists(ids, min_size=1, max_size=5),
    truncate_prompt_tokens=st.none() | st.integers(1, 1000),
)
new_requests = st.builds(NewRequestData, names, token_lists, token_lists, sampling_params, token_lists, ids)
cached_requests = st.builds(CachedRequestData, names, token_lists, token_lists, ids)
scheduler_outputs = st.builds(
    SchedulerOutput,
    st.lists(new_requests, max_size=3),
    st.lists(cached_requests, max_size=5),
    st.dictionaries(names, ids, max_size=5),
    ids,
    st.sets(names, max_size=4),
)
position_logprobs = st.tuples(token_lists, st.lists(floats, max_size=5), ids)
model_runner_outputs = st.builds(
    ModelRunnerOutput,
    st.lists(names, max_size=5),
    st.lists(token_lists, max_size=5),
    st.dictionaries(names, st.lists(position_logprobs, min_size=1, max_size=3), max_size=3),
    st.dictionaries(names, st.lists(position_logprobs, max_size=3), max_size=2),
)
grammar_outputs = st.builds(
    GrammarOutput, st.lists(names, max_size=4), st.binary(max_size=64), ids, st.lists(ids, max_size=4)
)
kv_cache_configs = st.builds(KVCacheConfig, ids, ids)
remote_errors = st.builds(RemoteError, names, st.text(), st.text(), ids, names)
callable_refs = st.builds(CallableRef, ids, names)
messages = st.one_of(
    scheduler_outputs,
    model_runner_outputs,
    grammar_outputs,
    kv_cache_configs,
    sampling_params,
    new_requests,
    cached_requests,
    remote_errors,
    callable_refs,
    structured.filter(lambda s: s is not None),
)
# What call arguments and return values are made of.
plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | floats | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=4) | st.integers(0, 100), inner, max_size=3)
    ),
    max_leaves=10,
)
values = plain_values | messages
requests = st.builds(
    RpcRequest,
    ids,
    names | callable_refs,
    st.lists(values, max_size=3).map(tuple),
    st.dictionaries(st.text(max_size=5), values, max_size=2),
    st.none() | ids,
)
replies = st.builds(RpcReply, ids, st.sampled_from(["ok", "error", "fatal"]), values | remote_errors)


def _same(a, b) -> None:
    """Equal, and of the same types all the way down (== alone takes a list for a tuple)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def test_every_declared_type_is_covered_by_these_strategies():
    covered = {
        SchedulerOutput,
        NewRequestData,
        CachedRequestData,
        GrammarOutput,
        ModelRunnerOutput,
        KVCacheConfig,
        SamplingParams,
        StructuredOutputsParams,
        RemoteError,
        CallableRef,
    }
    assert set(DEFAULT_MESSAGE_TYPES) == covered
    assert set(DEFAULT_RECORD_TYPES) == {RpcRequest, RpcReply}


def _out_of_range_ints(value) -> list[int]:
    """Every int in a message that msgpack cannot hold (the test's own walk)."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if type(value) is int:
        return [value] if not _INT_MIN <= value <= _INT_MAX else []
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set)):
        return [i for item in value for i in _out_of_range_ints(item)]
    return []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
@example(StructuredOutputsParams(json={"": -9223372036854775809}))  # issue 21
def test_messages_round_trip_with_their_types(message):
    """Round trip, or, for an int msgpack cannot hold, a clear refusal naming it."""
    too_big = _out_of_range_ints(message)
    if not too_big:
        _same(CODEC.decode(CODEC.encode(message)), message)
        return
    with pytest.raises(UnencodableValueError) as refused:
        CODEC.encode(message)
    assert any(f" = {value} cannot travel" in str(refused.value) for value in too_big), refused.value


def test_an_int_past_64_bits_is_refused_naming_where_it_sits():
    for value in (_INT_MIN - 1, _INT_MAX + 1):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"maximum": [1, value]}))
        where = re.escape(f"RpcRequest.args[0].structured_outputs.json['maximum'][1] = {value} ")
        with pytest.raises(UnencodableValueError, match=f"^{where}"):
            CODEC.encode(RpcRequest(1, "execute_model", (params,), {}, None))
    # Both a refusal of the codec and a ValueError (a 400 at intake).
    assert issubclass(UnencodableValueError, UndeclaredTypeError) and issubclass(UnencodableValueError, ValueError)
    with pytest.raises(UnencodableValueError, match=r"^dict\[3\]"):
        CODEC.encode({3: 2**64})
    _same(CODEC.decode(CODEC.encode([_INT_MIN, _INT_MAX])), [_INT_MIN, _INT_MAX])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(requests, replies))
def test_rpc_envelopes_round_trip_with_their_contents_typed(envelope):
    if _out_of_range_ints(envelope):
        with pytest.raises(UnencodableValueError):
            CODEC.encode(envelope)
        return
    decoded = CODEC.decode(CODEC.encode(envelope))
    assert type(decoded) is type(envelope)
    _same(tuple(decoded), tuple(envelope))


def test_a_step_decodes_to_its_own_classes_nested_and_sets_included():
    params = SamplingParams(temperature=0.5, logit_bias={3: 1.5}, allowed_token_ids=[9, 4], stop="x")
    step = SchedulerOutput(
        [NewRequestData("a", [1, 2], [], params, [0], 0)],
        [CachedRequestData("b", [5], [], 3)],
        {"a": 2, "b": 1},
        3,
        {"gone"},
    )
    call = CODEC.decode(CODEC.encode(RpcRequest(4, "execute_model", (step,), {}, 0)))
    got = call.args[0]
    assert isinstance(got, SchedulerOutput) and got == step
    assert isinstance(got.finished_req_ids, set)
    assert got.scheduled_new_reqs[0].sampling_params.logit_bias == {3: 1.5}
    assert got.scheduled_new_reqs[0].sampling_params.allowed_token_ids == [4, 9]


def test_arrays_and_tensors_travel_as_dtype_shape_and_bytes():
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([[1, -2]], dtype=np.int64), np.zeros(0, np.uint8)]
    for array in arrays:
        got = CODEC.decode(CODEC.encode(array))
        assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
    for tensor in (torch.randn(2, 3), torch.randn(4, 2).to(torch.bfloat16), torch.arange(5)[::2]):
        got = CODEC.decode(CODEC.encode(RpcReply(0, "ok", [tensor])))[2][0]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)


def test_an_object_array_is_refused_both_ways():
    with pytest.raises(UndeclaredTypeError, match="dtype object"):
        CODEC.encode(np.array([object()]))
    # A crafted header asking for object dtype: raw bytes would become pointers.
    ext = CODEC.encode(np.zeros(2, dtype=np.int64))
    forged = ext.replace(b"<i8", b"|O8")
    with pytest.raises(ValueError, match="only plain numbers"):
        CODEC.decode(forged)


class Unregistered:
    pass


@pytest.mark.parametrize(
    "value, named",
    [
        (Unregistered(), "test_message_codec.Unregistered"),
        (RpcRequest(0, "m", (Unregistered(),), {}, None), "test_message_codec.Unregistered"),
        (RpcReply(0, "ok", {"k": [1, {2, 3}]}), "builtins.set"),
        (KVCacheConfig(num_blocks=Unregistered(), block_size=1), "Unregistered (inside a message)"),
        ({(1, 2): "tuple key"}, "builtins.tuple (as a dict key)"),
        (np.float32(1.0), "numpy.float32"),
    ],
)
def test_an_undeclared_type_fails_at_encode_naming_it(value, named):
    with pytest.raises(UndeclaredTypeError, match=named.replace("(", r"\(").replace(")", r"\)")):
        CODEC.encode(value)


def test_a_callable_is_refused_unless_allowed_and_decoded_only_when_trusted():
    def rank_plus(worker, k):
        return worker.rank + k

    with pytest.raises(CallableNotAllowedError, match="rank_plus"):
        CODEC.encode(RpcRequest(0, rank_plus, (1,), {}, None))
    data = CODEC.encode(RpcRequest(0, rank_plus, (1,), {}, None), allow_callables=True)
    with pytest.raises(UntrustedPayloadError):
        CODEC.decode(data)
    call = CODEC.decode(data, trusted=True)
    assert call.method(type("W", (), {"rank": 2})(), *call.args) == 3


def test_a_pickle_is_never_loaded(tmp_path):
    """Bytes a peer on the network could craft: the old pickle extension, a
    bare pickle, a pickle inside a tuple. None runs; the file never appears."""
    target = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(target), "w"))

    evil = pickle.dumps(Exploit(), protocol=5)
    forged = [
        msgspec.msgpack.encode(msgspec.msgpack.Ext(3, evil)),
        evil,
        msgspec.msgpack.encode(msgspec.msgpack.Ext(2, msgspec.msgpack.encode([msgspec.msgpack.Ext(3, evil)]))),
    ]
    for data in forged:
        with pytest.raises((UntrustedPayloadError, msgspec.DecodeError, ValueError)):
            CODEC.decode(data)
    assert not target.exists()
