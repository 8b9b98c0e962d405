"""A bounded walk over a GGUF file's header, before the `gguf` package reads it.

GGUF files come from the Hub and are untrusted. gguf's reader believes every
count and length in the header: a uint8 array declaring 2**40 elements in a
73-byte file makes it loop 2**40 times, growing memory as it goes. This walk
reads the same layout with `struct`, and checks every declared count or length
against the bytes left in the file (and against limits no real model comes
near) before reading what it declares; a bad file is a ValueError naming the
metadata key or tensor at fault. Only files that pass go to gguf's reader.

Layout (GGUF versions 2 and 3, every integer in the file's byte order):
    magic "GGUF", version u32, tensor count u64, metadata count u64
    metadata: key (string), value type u32, value
        string = length u64 + bytes; array = item type u32 + count u64 + items
    tensor infos: name (string), n_dims u32, dims u64[n_dims], type u32,
        offset u64 (from the start of the data section)
    padding to general.alignment (default 32), then the tensors' data.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

SUPPORTED_VERSIONS = (2, 3)  # those gguf's reader reads; version 1 had 32-bit counts

# Limits far above any real model's, low enough that the work gguf's reader
# does per entry stays bounded (about 9 us and 650 bytes per array element).
MAX_TENSORS = 1 << 16  # a dense 405B Llama has about 1,100 tensors
MAX_METADATA_KEYS = 1 << 16  # real files have under a hundred
MAX_KEY_BYTES = (1 << 16) - 1  # the GGUF spec's limit on a key
MAX_TENSOR_NAME_BYTES = 64  # the GGUF spec's limit (ggml's GGML_MAX_NAME)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_NESTING = 2  # an array of arrays at most; llama.cpp writes flat arrays
# Array elements, one array and all of them: the largest tokenizers (262,144
# tokens; 446,189 merges) come to about a million elements over all arrays.
MAX_ARRAY_ELEMENTS = 1 << 20
MAX_TOTAL_ARRAY_ELEMENTS = 1 << 21

_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}
# The fewest bytes one value of each type takes: a string its length, an array
# its item type and count. A count times this must fit in the bytes left.
_MIN_SIZES = {**_SCALAR_SIZES, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
# name length + n_dims + type + offset: the fewest bytes of one tensor info.
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8
# key length + value type + the smallest value: the fewest bytes of one key.
_MIN_KEY_VALUE = 8 + 4 + 1


class _Cursor:
    """Reads the header front to back; every read first checks that the bytes
    it needs are in the file, so no declared size is trusted."""

    def __init__(self, buf: mmap.mmap, byte_order: str):
        self.buf, self.pos, self.order = buf, 0, byte_order

    def left(self) -> int:
        return len(self.buf) - self.pos

    def skip(self, n: int, what: str) -> int:
        if n > self.left():
            raise ValueError(f"{what} needs {n} bytes at offset {self.pos}, only {self.left()} are left in the file")
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from(self.order + "I", self.buf, self.skip(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from(self.order + "Q", self.buf, self.skip(8, what))[0]

    def string(self, what: str, limit: int) -> bytes:
        """A key or tensor name: short, so read."""
        length = self.u64(f"the length of {what}")
        if length > limit:
            raise ValueError(f"{what} is {length} bytes long, more than the {limit} allowed")
        start = self.skip(length, what)
        return bytes(self.buf[start : start + length])

    def skip_string(self, what: str) -> None:
        """A string value: only its length is checked (a chat template may be long)."""
        self.skip(self.u64(f"the length of {what}"), what)


def _decode(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not UTF-8: {raw[:64]!r}") from None


def _value_type(raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ValueError(f"{what} has unknown value type {raw}") from None


class _ArrayBudget:
    """Counts array elements over the whole metadata (see MAX_TOTAL_ARRAY_ELEMENTS)."""

    def __init__(self):
        self.used = 0

    def spend(self, count: int, key: str) -> None:
        if count > MAX_ARRAY_ELEMENTS:
            raise ValueError(
                f"metadata key {key!r}: array of {count} elements, more than the {MAX_ARRAY_ELEMENTS} allowed"
            )
        self.used += count
        if self.used > MAX_TOTAL_ARRAY_ELEMENTS:
            raise ValueError(
                f"metadata key {key!r}: the metadata's arrays hold more than {MAX_TOTAL_ARRAY_ELEMENTS} elements in all"
            )


def _skip_value(cur: _Cursor, vtype: GGUFValueType, key: str, budget: _ArrayBudget, depth: int = 0) -> None:
    what = f"metadata key {key!r}"
    if vtype in _SCALAR_SIZES:
        cur.skip(_SCALAR_SIZES[vtype], f"the value of {what}")
    elif vtype == GGUFValueType.STRING:
        cur.skip_string(f"the string value of {what}")
    else:  # ARRAY
        if depth >= MAX_ARRAY_NESTING:
            raise ValueError(f"{what}: arrays nested more than {MAX_ARRAY_NESTING} deep")
        item_type = _value_type(cur.u32(f"the item type of {what}"), f"an item of {what}")
        count = cur.u64(f"the array count of {what}")
        budget.spend(count, key)
        least = count * _MIN_SIZES[item_type]
        if least > cur.left():
            raise ValueError(
                f"{what}: array of {count} {item_type.name} elements needs at least {least} bytes, "
                f"only {cur.left()} are left in the file"
            )
        if item_type in _SCALAR_SIZES:
            cur.skip(least, f"the array of {what}")
        else:  # strings or arrays: sizes vary, walked one by one (count is bounded above)
            for _ in range(count):
                _skip_value(cur, item_type, key, budget, depth + 1)


def _read_metadata(cur: _Cursor, kv_count: int) -> int:
    """Walks the metadata; returns general.alignment (or the default)."""
    budget = _ArrayBudget()
    seen: set[str] = set()
    alignment = GGUF_DEFAULT_ALIGNMENT
    for index in range(kv_count):
        key = _decode(cur.string(f"metadata key #{index}", MAX_KEY_BYTES), f"metadata key #{index}")
        if key in seen:
            raise ValueError(f"metadata key {key!r} appears twice")
        seen.add(key)
        vtype = _value_type(cur.u32(f"the value type of metadata key {key!r}"), f"metadata key {key!r}")
        if key == "general.alignment":
            alignment = _read_alignment(cur, vtype)
        else:
            _skip_value(cur, vtype, key, budget)
    return alignment


def _read_alignment(cur: _Cursor, vtype: GGUFValueType) -> int:
    # The data section's start depends on it, so its value is read, not skipped.
    if vtype != GGUFValueType.UINT32:
        raise ValueError(f"metadata key 'general.alignment' has type {vtype.name}, not UINT32")
    alignment = cur.u32("the value of metadata key 'general.alignment'")
    if alignment == 0 or alignment & (alignment - 1):
        raise ValueError(f"metadata key 'general.alignment' is {alignment}, not a power of two")
    return alignment


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]
    n_bytes: int
    offset: int  # from the start of the data section


def _read_tensor_info(cur: _Cursor, index: int, seen: set[str]) -> _TensorInfo:
    raw_name = cur.string(f"the name of tensor #{index}", MAX_TENSOR_NAME_BYTES)
    name = _decode(raw_name, f"the name of tensor #{index}")
    what = f"tensor {name!r}"
    if name in seen:
        raise ValueError(f"{what} appears twice")
    seen.add(name)
    n_dims = cur.u32(f"the n_dims of {what}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise ValueError(f"{what} has n_dims {n_dims}, not 1 to {MAX_DIMS}")
    dims = tuple(cur.u64(f"the dims of {what}") for _ in range(n_dims))
    raw_type = cur.u32(f"the type of {what}")
    offset = cur.u64(f"the data offset of {what}")
    return _TensorInfo(name, dims, _data_bytes(what, dims, raw_type), offset)


def _data_bytes(what: str, dims: tuple[int, ...], raw_type: int) -> int:
    """The bytes of a tensor's data; Python integers, so a product of huge dims
    cannot wrap around (numpy's uint64 product, which gguf uses, does)."""
    try:
        ggml_type = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise ValueError(f"{what} has unknown ggml type {raw_type}") from None
    if any(d < 1 for d in dims):
        raise ValueError(f"{what} has an empty dimension: dims {list(dims)}")
    if dims[0] % block_size:
        raise ValueError(f"{what}: its rows of {dims[0]} are not whole {ggml_type.name} blocks of {block_size}")
    n_elements = 1
    for d in dims:
        n_elements *= d
    return n_elements // block_size * type_size


def check_header(path: str | os.PathLike) -> None:
    """Checks the header of the GGUF file at `path`, and that every tensor's
    data lies inside the file; ValueError naming the field at fault otherwise."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:  # magic, version and the two counts
            raise ValueError(f"the file has {size} bytes, too few for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _walk(buf)


def _walk(buf: mmap.mmap) -> None:
    if struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
        raise ValueError("no GGUF magic at the start of the file")
    # Written in the writer's byte order: a big-endian file's small version
    # number reads as a multiple of 65536 in little-endian (gguf's own test).
    order = ">" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF == 0 else "<"
    cur = _Cursor(buf, order)
    cur.skip(4, "the magic")
    version = cur.u32("the version")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (versions {SUPPORTED_VERSIONS} are)")
    tensor_count = cur.u64("the tensor count")
    kv_count = cur.u64("the metadata key count")
    _check_count("tensor count", tensor_count, MAX_TENSORS, _MIN_TENSOR_INFO, cur.left())
    _check_count("metadata key count", kv_count, MAX_METADATA_KEYS, _MIN_KEY_VALUE, cur.left())
    alignment = _read_metadata(cur, kv_count)
    seen: set[str] = set()
    infos = [_read_tensor_info(cur, i, seen) for i in range(tensor_count)]
    data_start = -(-cur.pos // alignment) * alignment
    for info in infos:
        _check_placement(info, data_start, alignment, len(buf))


def _check_count(field: str, count: int, limit: int, least_bytes: int, left: int) -> None:
    if count > limit:
        raise ValueError(f"header {field} is {count}, more than the {limit} allowed")
    if count * least_bytes > left:
        raise ValueError(
            f"header {field} is {count}: at least {count * least_bytes} bytes, only {left} are left in the file"
        )


def _check_placement(info: _TensorInfo, data_start: int, alignment: int, size: int) -> None:
    what = f"tensor {info.name!r}"
    if info.offset % alignment:
        raise ValueError(f"{what} has data offset {info.offset}, not a multiple of the alignment {alignment}")
    end = data_start + info.offset + info.n_bytes
    if end > size:
        raise ValueError(f"{what} needs bytes up to {end} (dims {list(info.dims)}), the file has {size}")
