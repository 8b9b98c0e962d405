"""Bytes for the step queues: typed msgpack (msgspec), and nothing else.

Queues may cross the network (ZMQ over TCP to other nodes), so decoding must
never run code chosen by whoever produced the bytes: there is no pickle on the
decode path. What may travel is declared here:

- primitives (None, bool, int, float, str, bytes), lists, tuples, and dicts
  with str or int keys, nested freely;
- the declared messages (DEFAULT_MESSAGE_TYPES): dataclasses encoded and
  decoded with their own typed msgspec codec, so a SchedulerOutput decodes as a
  SchedulerOutput, nested dataclasses and sets included, with no per-field
  Python on our side;
- the declared records (DEFAULT_RECORD_TYPES): the rpc envelopes, whose fields
  hold any of the above (the arguments and return values of calls);
- numpy arrays and torch tensors, as (dtype, shape, raw bytes);
- a callable, only when the encoder is told it may (`allow_callables`) and the
  decoder that the bytes came from a trusted place (`trusted`): the writer of a
  local shared-memory queue (see MessageQueue's `local_callables`).

Anything else fails at encode time with UndeclaredTypeError naming its type,
so whoever adds a field of a new type learns it in the first test that sends one;
an int that msgpack cannot hold (past 64 bits) with UnencodableValueError
naming where it sits.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

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

# msgpack extension codes used on the wire.
_EXT_MESSAGE = 1  # u16 type id + the message's typed msgpack
_EXT_TUPLE = 2  # msgpack array of the wrapped items
_EXT_CALLABLE = 3  # cloudpickle: decoded only when trusted
_EXT_RECORD = 4  # u16 type id + msgpack array of the wrapped fields
_EXT_ARRAY = 5  # u32 header length + header (framework, dtype, shape) + raw bytes

DEFAULT_MESSAGE_TYPES: tuple[type, ...] = (
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
)
# Records (NamedTuples) hold arbitrary (declared) values, which a typed
# decoder could not give back their types: each field is wrapped on its own.
DEFAULT_RECORD_TYPES: tuple[type, ...] = (RpcRequest, RpcReply)

_PRIMITIVES = (type(None), bool, int, float, str, bytes)
_CALLABLE_TYPES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)
_TYPE_ID = struct.Struct("<H")
_ARRAY_HEADER_LEN = struct.Struct("<I")
# Raw bytes are only ever read as plain numbers: an object dtype would turn
# bytes from the wire into pointers.
_ARRAY_KINDS = frozenset("biufc")


class UndeclaredTypeError(TypeError):
    """A value of a type the queues do not carry."""


class UnencodableValueError(UndeclaredTypeError, ValueError):
    """A value of a type the queues carry that msgpack cannot hold: an int
    outside [-2**63, 2**64 - 1]. A ValueError too: the value, not its type,
    is wrong (and intake code turns ValueErrors into a 400)."""


class CallableNotAllowedError(UndeclaredTypeError):
    """A callable where code may not travel (any socket, or a codec not told it may)."""


class UntrustedPayloadError(ValueError):
    """Bytes that ask for code to be run, from a source that may not send code."""


def _type_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _undeclared(kind: type, where: str = "") -> UndeclaredTypeError:
    return UndeclaredTypeError(
        f"{_type_name(kind)}{where} cannot travel on a step queue: only primitives, lists, tuples, "
        "dicts with str/int keys, numpy arrays, torch tensors and the declared messages "
        "(raylm.distributed.message_codec.DEFAULT_MESSAGE_TYPES) are encoded; declare it there"
    )


_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def _int_out_of_range(obj: Any) -> UnencodableValueError | OverflowError:
    for where, value in _ints(obj, type(obj).__name__):
        if not _INT_MIN <= value <= _INT_MAX:
            return UnencodableValueError(
                f"{where} = {value} cannot travel on a step queue: integers are carried in [-2**63, 2**64 - 1]"
            )
    return OverflowError("an integer out of msgpack's range, not found in the value")  # never expected


def _ints(obj: Any, where: str) -> Iterator[tuple[str, int]]:
    """(path, value) of every int in a value, messages and records included."""
    if type(obj) is int:
        yield where, obj
    elif type(obj) in (list, tuple):
        for i, item in enumerate(obj):
            yield from _ints(item, f"{where}[{i}]")
    elif isinstance(obj, (set, frozenset)):
        for item in obj:
            yield from _ints(item, f"{where}{{...}}")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _ints(key, f"{where} (a key)")
            yield from _ints(value, f"{where}[{key!r}]")
    else:
        for name in _field_names(obj):
            yield from _ints(getattr(obj, name), f"{where}.{name}")


def _field_names(obj: Any) -> list[str]:
    if hasattr(obj, "_fields"):  # a record (NamedTuple)
        return list(obj._fields)
    if isinstance(obj, msgspec.Struct):
        return list(obj.__struct_fields__)
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    return []


class MessageCodec:
    """encode(obj) -> bytes and decode(buffer) -> obj, with typed messages."""

    def __init__(
        self,
        message_types: Iterable[type] = DEFAULT_MESSAGE_TYPES,
        record_types: Iterable[type] = DEFAULT_RECORD_TYPES,
    ):
        message_types, record_types = list(message_types), list(record_types)
        # Ids are positions: both ends must run the same raylm version.
        self._types = message_types + record_types
        self._message_ids = {t: i for i, t in enumerate(message_types)}
        self._record_ids = {t: i + len(message_types) for i, t in enumerate(record_types)}
        for t in record_types:
            if not (issubclass(t, tuple) and hasattr(t, "_fields")):
                raise TypeError(f"record type {_type_name(t)} must be a NamedTuple")
        self._record_fields = {self._record_ids[t]: t._fields for t in record_types}
        # Fields annotated `tuple` travel as plain arrays and are made tuples
        # again on decode: one nesting level (an encode and a copy) less for
        # the arguments of every call.
        self._record_tuple_fields = {
            self._record_ids[t]: tuple(
                i for i, name in enumerate(t._fields) if t.__annotations__.get(name) in ("tuple", tuple)
            )
            for t in record_types
        }
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._plain_decoder = msgspec.msgpack.Decoder()
        # One decoder per trust level: an ext hook cannot tell where it was called from.
        self._untrusted = msgspec.msgpack.Decoder(ext_hook=functools.partial(self._ext_hook, False))
        self._trusted = msgspec.msgpack.Decoder(ext_hook=functools.partial(self._ext_hook, True))
        self._typed_decoders: dict[int, msgspec.msgpack.Decoder] = {}

    # ---- encoding -----------------------------------------------------------------

    def encode(self, obj: Any, allow_callables: bool = False) -> bytes:
        """Raises UndeclaredTypeError (before anything is produced) for a value
        that cannot travel; CallableNotAllowedError for a callable unless
        allowed; UnencodableValueError for an int past 64 bits."""
        try:
            return self._encoder.encode(self._wrap(obj, allow_callables))
        except OverflowError:
            # msgspec says only "can't serialize ints < -2**63": find which one,
            # once, on this error path only.
            raise _int_out_of_range(obj) from None

    def _wrap(self, obj: Any, allow_callables: bool) -> Any:
        kind = type(obj)
        if kind in _PRIMITIVES:
            return obj
        type_id = self._message_ids.get(kind)
        if type_id is not None:
            return msgspec.msgpack.Ext(_EXT_MESSAGE, _TYPE_ID.pack(type_id) + self._encoder.encode(obj))
        type_id = self._record_ids.get(kind)
        if type_id is not None:
            values = [self._wrap(value, allow_callables) for value in obj]
            for i in self._record_tuple_fields[type_id]:
                if type(values[i]) is msgspec.msgpack.Ext and values[i].code == _EXT_TUPLE:
                    # Its items as a plain array: the field's type says tuple already.
                    values[i] = msgspec.Raw(values[i].data)
            return msgspec.msgpack.Ext(_EXT_RECORD, _TYPE_ID.pack(type_id) + self._encoder.encode(values))
        if kind is list:
            return [self._wrap(item, allow_callables) for item in obj]
        if kind is tuple:
            items = [self._wrap(item, allow_callables) for item in obj]
            return msgspec.msgpack.Ext(_EXT_TUPLE, self._encoder.encode(items))
        if kind is dict:
            for key in obj:
                if type(key) not in (str, int):
                    raise _undeclared(type(key), " (as a dict key)")
            return {k: self._wrap(v, allow_callables) for k, v in obj.items()}
        if isinstance(obj, _CALLABLE_TYPES):
            if not allow_callables:
                raise CallableNotAllowedError(
                    f"a callable ({getattr(obj, '__qualname__', kind.__name__)}) cannot travel here: code is "
                    "sent only on a local shared-memory queue; on the Ray backend collective_rpc registers "
                    "callables on the workers through Ray and sends a CallableRef"
                )
            import cloudpickle  # only the multiprocess executor's local queue gets here

            return msgspec.msgpack.Ext(_EXT_CALLABLE, cloudpickle.dumps(obj, protocol=5))
        array = self._encode_array(obj)
        if array is not None:
            return array
        raise _undeclared(kind)

    def _enc_hook(self, obj: Any) -> Any:
        # Reached for values inside a message that msgpack cannot hold natively.
        array = self._encode_array(obj)
        if array is None:
            raise _undeclared(type(obj), " (inside a message)")
        return array

    def _encode_array(self, obj: Any) -> msgspec.msgpack.Ext | None:
        # sys.modules, not import: a process that never imported numpy or
        # torch cannot hold their arrays, and need not pay for the import.
        torch = sys.modules.get("torch")
        numpy = sys.modules.get("numpy")
        if torch is not None and isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            framework, dtype_name = "torch", str(tensor.dtype).removeprefix("torch.")
            # numpy has no bfloat16: the bits travel as int16 and are viewed back.
            array = (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()
        elif numpy is not None and isinstance(obj, numpy.ndarray):
            framework, array = "numpy", numpy.ascontiguousarray(obj)
            dtype_name = array.dtype.str
        else:
            return None
        if array.dtype.kind not in _ARRAY_KINDS:
            raise _undeclared(type(obj), f" of dtype {array.dtype}")
        header = self._encoder.encode([framework, dtype_name, array.dtype.str, list(array.shape)])
        return msgspec.msgpack.Ext(_EXT_ARRAY, _ARRAY_HEADER_LEN.pack(len(header)) + header + array.tobytes())

    # ---- decoding -----------------------------------------------------------------

    def decode(self, data: bytes | memoryview, trusted: bool = False) -> Any:
        """`trusted` only for bytes from the writer of a local shared-memory
        queue (the same user's process): only then may they carry a callable."""
        return (self._trusted if trusted else self._untrusted).decode(data)

    def _ext_hook(self, trusted: bool, code: int, data: memoryview) -> Any:
        if code == _EXT_MESSAGE:
            type_id = _TYPE_ID.unpack_from(data)[0]
            decoder = self._typed_decoders.get(type_id) or self._typed_decoder(type_id)
            return decoder.decode(data[_TYPE_ID.size :])
        if code == _EXT_TUPLE:
            return tuple((self._trusted if trusted else self._untrusted).decode(data))
        if code == _EXT_RECORD:
            (type_id,) = _TYPE_ID.unpack_from(data)
            names = self._record_fields.get(type_id)
            if names is None:
                raise ValueError(f"unknown record type id {type_id}")
            values = (self._trusted if trusted else self._untrusted).decode(data[_TYPE_ID.size :])
            if type(values) is not list or len(values) != len(names):
                raise ValueError(f"malformed {self._types[type_id].__name__} record")
            for i in self._record_tuple_fields[type_id]:
                if type(values[i]) is list:
                    values[i] = tuple(values[i])
            return tuple.__new__(self._types[type_id], values)
        if code == _EXT_ARRAY:
            return self._decode_array(data)
        if code == _EXT_CALLABLE:
            if not trusted:
                raise UntrustedPayloadError(
                    "refusing a pickled callable from a source that may not send code "
                    "(only a local shared-memory queue's writer may)"
                )
            import cloudpickle

            return cloudpickle.loads(data)
        raise ValueError(f"unknown msgpack extension code {code}")

    def _typed_decoder(self, type_id: int) -> msgspec.msgpack.Decoder:
        decoder = self._typed_decoders.get(type_id)
        if decoder is None:
            if type_id not in self._message_ids.values():
                raise ValueError(f"unknown message type id {type_id}")
            # Untrusted whatever the queue: messages never hold callables.
            decoder = msgspec.msgpack.Decoder(
                type=self._types[type_id], ext_hook=functools.partial(self._ext_hook, False)
            )
            self._typed_decoders[type_id] = decoder
        return decoder

    def _decode_array(self, data: memoryview) -> Any:
        import numpy

        (header_len,) = _ARRAY_HEADER_LEN.unpack_from(data)
        start = _ARRAY_HEADER_LEN.size + header_len
        framework, dtype_name, numpy_dtype, shape = self._plain_decoder.decode(data[_ARRAY_HEADER_LEN.size : start])
        dtype = numpy.dtype(numpy_dtype)
        if dtype.kind not in _ARRAY_KINDS:
            raise ValueError(f"refusing an array of dtype {dtype}: only plain numbers travel")
        # A copy: `data` may be a shared-memory chunk the writer reuses.
        array = numpy.frombuffer(data[start:], dtype=dtype).reshape(shape).copy()
        if framework == "numpy":
            return array
        import torch

        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if dtype_name == "bfloat16" else tensor
