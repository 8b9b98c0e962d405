"""Moving a request's KV cache blocks between two engines' workers (live
migration, see raylm.engine.migration): the source rank writes the blocks to a
file in shared memory, the destination's rank of the same index reads them
into blocks of its own paged cache.

One file per rank and stage: a fixed-size JSON header that says what the data
is (dtype, layers, block geometry, number of blocks), then each layer's K and
V blocks, raw. The destination checks the header against its own cache, so
engines of different layouts (TP, PP, dtype, block size, model) refuse the
transfer with a clear error instead of importing wrong data.

Both sides map the file (torch's from_file) and copy once: gather the blocks
from the cache into the mapping, scatter them from the mapping into the cache.
A file on /dev/shm never touches a disk.
"""

from __future__ import annotations

import json
import os

import torch

_MAGIC = "raylm-kv-blocks"
_VERSION = 1
_HEADER_BYTES = 4096


class KVTransferError(ValueError):
    """A transfer file that cannot be imported here (missing, truncated, or of another layout)."""


def rank_path(path_prefix: str, rank: int) -> str:
    return f"{path_prefix}.rank{rank}"


def _layout(kv_caches: list[torch.Tensor]) -> dict:
    """What must match between the two sides: per layer [2, blocks, block_size, kv_heads, head_dim]."""
    first = kv_caches[0]
    return {
        "dtype": str(first.dtype).removeprefix("torch."),
        "num_layers": len(kv_caches),
        "block_shape": list(first.shape[2:]),
    }


def _block_numel(kv_caches: list[torch.Tensor]) -> int:
    """Elements of one block of one layer, K and V."""
    return 2 * kv_caches[0][0, 0].numel()


def export_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], path: str) -> int:
    """Write the blocks `block_ids` of every layer to `path`; returns the bytes written."""
    if not kv_caches:
        raise KVTransferError("this rank holds no KV cache")
    header = {"magic": _MAGIC, "version": _VERSION, "num_blocks": len(block_ids), **_layout(kv_caches)}
    encoded = json.dumps(header).encode()
    if len(encoded) > _HEADER_BYTES:
        raise KVTransferError("KV transfer header too long")
    first = kv_caches[0]
    per_layer = _block_numel(kv_caches) * len(block_ids)
    data_bytes = per_layer * len(kv_caches) * first.element_size()
    # Created fresh (O_EXCL): a stale file of an earlier transfer is never read as this one.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, _HEADER_BYTES + data_bytes)
        os.pwrite(fd, encoded, 0)
    finally:
        os.close(fd)
    if not block_ids:
        return _HEADER_BYTES
    mapped = _map(path, first.dtype, _HEADER_BYTES + data_bytes, writable=True)
    index = torch.tensor(block_ids, dtype=torch.int64, device=first.device)
    for layer, cache in enumerate(kv_caches):
        out = mapped[layer * per_layer : (layer + 1) * per_layer].view(2, len(block_ids), *cache.shape[2:])
        if cache.device.type == "cpu":
            torch.index_select(cache, 1, index, out=out)  # gathered straight into the mapping
        else:
            out.copy_(cache.index_select(1, index))
    return _HEADER_BYTES + data_bytes


def import_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], path: str) -> int:
    """Read a file written by `export_blocks` into the blocks `block_ids`
    (one per exported block, in order); returns the bytes read."""
    if not kv_caches:
        raise KVTransferError("this rank holds no KV cache")
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise KVTransferError(f"KV transfer file {path!r} cannot be read: {e}") from e
    try:
        header = json.loads(raw.rstrip(b"\0"))
    except ValueError as e:
        raise KVTransferError(f"KV transfer file {path!r} has no valid header") from e
    if header.get("magic") != _MAGIC or header.get("version") != _VERSION:
        raise KVTransferError(f"{path!r} is not a raylm KV transfer file of version {_VERSION}")
    mine = _layout(kv_caches)
    theirs = {key: header.get(key) for key in mine}
    if theirs != mine:
        raise KVTransferError(f"KV layouts differ: the source rank holds {theirs}, this rank {mine} "
                              "(engines must have the same model, dtype, block size and TP/PP layout)")
    if header.get("num_blocks") != len(block_ids):
        raise KVTransferError(f"{path!r} holds {header.get('num_blocks')} blocks, {len(block_ids)} were reserved")
    first = kv_caches[0]
    per_layer = _block_numel(kv_caches) * len(block_ids)
    expected = _HEADER_BYTES + per_layer * len(kv_caches) * first.element_size()
    if size != expected:
        raise KVTransferError(f"KV transfer file {path!r} is truncated or padded ({size} bytes, {expected} expected)")
    if not block_ids:
        return size
    mapped = _map(path, first.dtype, size, writable=False)
    index = torch.tensor(block_ids, dtype=torch.int64, device=first.device)
    for layer, cache in enumerate(kv_caches):
        src = mapped[layer * per_layer : (layer + 1) * per_layer].view(2, len(block_ids), *cache.shape[2:])
        cache.index_copy_(1, index, src.to(cache.device))
    return size


def _map(path: str, dtype: torch.dtype, size: int, writable: bool) -> torch.Tensor:
    """The data part of the file as a flat tensor of `dtype`, mapped (no copy).
    shared=True writes through to the file; shared=False maps it privately
    (copy on write), which reading never triggers."""
    storage = torch.UntypedStorage.from_file(path, shared=writable, nbytes=size)
    element = torch.empty((), dtype=dtype).element_size()
    return torch.tensor([], dtype=dtype).set_(storage, _HEADER_BYTES // element, ((size - _HEADER_BYTES) // element,))
