"""Bytes for the step queues: msgpack (msgspec) for raylm's own message
dataclasses, pickle protocol 5 for anything else, cloudpickle for callables.

Our messages keep their type across the wire (a SchedulerOutput decodes as a
SchedulerOutput, with its nested dataclasses and sets), and tuples stay tuples,
because msgspec's plain decoding would turn both into lists and dicts.
"""

from __future__ import annotations

import functools
import pickle
import struct
import types
from typing import Any, Iterable

import cloudpickle
import msgspec

from raylm.messages import (
    CachedRequestData,
    GrammarOutput,
    KVCacheConfig,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from raylm.sampling_params import SamplingParams

# msgpack extension codes used on the wire.
_EXT_MESSAGE = 1
_EXT_TUPLE = 2
_EXT_PICKLE = 3

DEFAULT_MESSAGE_TYPES: tuple[type, ...] = (
    SchedulerOutput,
    NewRequestData,
    CachedRequestData,
    GrammarOutput,
    ModelRunnerOutput,
    KVCacheConfig,
    SamplingParams,
)

_PRIMITIVES = (type(None), bool, int, float, str, bytes)
_CALLABLE_TYPES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)
_TYPE_ID = struct.Struct("<H")


def _pickle(obj: Any) -> bytes:
    # Functions and lambdas from the driver may live in modules the worker
    # cannot import (a script's __main__): cloudpickle sends them by value.
    if isinstance(obj, _CALLABLE_TYPES):
        return cloudpickle.dumps(obj, protocol=5)
    try:
        return pickle.dumps(obj, protocol=5)
    except (pickle.PicklingError, AttributeError, TypeError):
        return cloudpickle.dumps(obj, protocol=5)


class MessageCodec:
    """encode(obj) -> bytes and decode(buffer) -> obj, with typed messages."""

    def __init__(self, message_types: Iterable[type] = DEFAULT_MESSAGE_TYPES):
        self._types = list(message_types)
        self._type_ids = {t: i for i, t in enumerate(self._types)}
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        self._typed_decoders: dict[int, msgspec.msgpack.Decoder] = {}

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(self._wrap(obj))

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)

    def _wrap(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _PRIMITIVES:
            return obj
        if kind in self._type_ids:
            body = self._encoder.encode(obj)
            return msgspec.msgpack.Ext(_EXT_MESSAGE, _TYPE_ID.pack(self._type_ids[kind]) + body)
        if kind is list:
            return [self._wrap(item) for item in obj]
        if kind is tuple:
            return msgspec.msgpack.Ext(_EXT_TUPLE, self._encoder.encode([self._wrap(item) for item in obj]))
        if kind is dict and all(type(k) in (str, int) for k in obj):
            return {k: self._wrap(v) for k, v in obj.items()}
        return msgspec.msgpack.Ext(_EXT_PICKLE, _pickle(obj))

    def _enc_hook(self, obj: Any) -> Any:
        # Reached for values nested inside a message that msgpack cannot hold.
        return msgspec.msgpack.Ext(_EXT_PICKLE, _pickle(obj))

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_MESSAGE:
            (type_id,) = _TYPE_ID.unpack_from(data)
            decoder = self._typed_decoders.get(type_id)
            if decoder is None:
                decoder = msgspec.msgpack.Decoder(type=self._types[type_id], ext_hook=self._ext_hook)
                self._typed_decoders[type_id] = decoder
            return decoder.decode(data[_TYPE_ID.size :])
        if code == _EXT_TUPLE:
            return tuple(self._decoder.decode(data))
        if code == _EXT_PICKLE:
            return pickle.loads(data)
        raise ValueError(f"unknown msgpack extension code {code}")
