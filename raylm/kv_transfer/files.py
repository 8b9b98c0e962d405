"""Moving a request's KV cache blocks between two engines' workers (live
migration, see raylm.engine.migration): the source rank writes the blocks to a
file in shared memory, the destination's rank of the same index reads them
into blocks of its own paged cache.

One file per rank and stage: a fixed-size JSON header that says what the data
is (dtype, layers, block geometry, number of blocks), then each layer's K and
V blocks, raw. The destination checks the header against its own cache, so
engines of different layouts (TP, PP, dtype, block size, model) refuse the
transfer with a clear error instead of importing wrong data.

Both sides copy once. A CPU cache is written to and read from the file
with positioned vector I/O (`pwritev` / `preadv`): each call moves a run of
the cache's blocks straight between the cache and the file's pages, with no
mapping to build and no gather into an intermediate buffer (about half the
CPU of a mapped `index_copy_` for the same blocks), and in chunks of at most
`_CHUNK_BYTES`, so that a copy beside the steps can pause between chunks
(raylm.kv_transfer.background paces it). A cache on an accelerator is gathered
into, and scattered from, a mapping of the file. A file on /dev/shm never
touches a disk. What costs CPU there is not the bytes but the pages: a fresh
file's shared-memory pages are allocated and zeroed one fault at a time,
several times the copy's own cost. So a source rank keeps the files it made
(hard links in the same folder, `_SpareFiles`) and fills one again once its
transfer is over (the supervisor unlinks a migration's files at its end),
and mappings are populated in one go (MAP_POPULATE).

Between nodes the same bytes travel in memory instead (`pack_blocks` /
`unpack_blocks`, carried by raylm.kv_transfer.network).
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_MAGIC = "raylm-kv-blocks"
_VERSION = 1
_HEADER_BYTES = 4096
# The most one system call of a CPU copy moves (~0.2-1 ms of CPU on a 2-core
# machine, more when its cache pages are touched for the first time): the
# granularity at which a paced copy beside the steps can give its core back.
_CHUNK_BYTES = 1 << 20
# An import waiting for its file's header looks again after at most this.
_MAX_RETRY_S = 0.008
_IOV_MAX = os.sysconf("SC_IOV_MAX")


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


def _header_bytes(kv_caches: list[torch.Tensor], num_blocks: int) -> bytes:
    header = {"magic": _MAGIC, "version": _VERSION, "num_blocks": num_blocks, **_layout(kv_caches)}
    encoded = json.dumps(header).encode()
    if len(encoded) > _HEADER_BYTES:
        raise KVTransferError("KV transfer header too long")
    return encoded


def _data_bytes(kv_caches: list[torch.Tensor], num_blocks: int) -> int:
    return _block_numel(kv_caches) * num_blocks * len(kv_caches) * kv_caches[0].element_size()


def _gather(
    kv_caches: list[torch.Tensor], block_ids: list[int], data: torch.Tensor, pause: Callable[[], None] | None = None
) -> None:
    """Copy the blocks `block_ids` of every layer into `data` (flat, of the
    caches' dtype), layer by layer; `pause` runs after each layer."""
    first = kv_caches[0]
    per_layer = _block_numel(kv_caches) * len(block_ids)
    index = torch.tensor(block_ids, dtype=torch.int64, device=first.device)
    for layer, cache in enumerate(kv_caches):
        out = data[layer * per_layer : (layer + 1) * per_layer].view(2, len(block_ids), *cache.shape[2:])
        if cache.device.type == "cpu":
            torch.index_select(cache, 1, index, out=out)  # gathered straight into the destination
        else:
            out.copy_(cache.index_select(1, index))
        if pause is not None:
            pause()


def _scatter(
    kv_caches: list[torch.Tensor], block_ids: list[int], data: torch.Tensor, pause: Callable[[], None] | None = None
) -> None:
    """The inverse of `_gather`: `data` into the blocks `block_ids` of every
    layer; `pause` runs after each layer."""
    first = kv_caches[0]
    per_layer = _block_numel(kv_caches) * len(block_ids)
    index = torch.tensor(block_ids, dtype=torch.int64, device=first.device)
    for layer, cache in enumerate(kv_caches):
        src = data[layer * per_layer : (layer + 1) * per_layer].view(2, len(block_ids), *cache.shape[2:])
        cache.index_copy_(1, index, src.to(cache.device))
        if pause is not None:
            pause()


def _copies_by_file_io(kv_caches: list[torch.Tensor]) -> bool:
    """A CPU cache laid out densely is copied with vector I/O (`_file_chunks`)."""
    return all(cache.device.type == "cpu" and cache.is_contiguous() for cache in kv_caches)


def _block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """`block_ids` as runs of consecutive ids, in order: (first id, count)."""
    runs: list[list[int]] = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1][1] += 1
        else:
            runs.append([block, 1])
    return [(first, count) for first, count in runs]


def _file_chunks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> Iterator[tuple[int, list[memoryview], int]]:
    """The copy of `block_ids` between the caches and a transfer file, as
    (file offset, the cache's byte ranges in file order, their total bytes),
    each at most `_CHUNK_BYTES` (or one block) and `_IOV_MAX` ranges. The
    file's order (`_gather`'s): layer, then K and V, then the blocks."""
    block_bytes = kv_caches[0][0, 0].numel() * kv_caches[0].element_size()
    num_blocks = kv_caches[0].shape[1]
    # Checked here: a slice of the cache past its end would silently be short.
    for block in block_ids:
        if not 0 <= block < num_blocks:
            raise KVTransferError(f"block {block} is out of bounds: this rank's cache holds {num_blocks} blocks")
    per_chunk = max(1, _CHUNK_BYTES // block_bytes)
    pieces = [
        (first + done, min(per_chunk, count - done))
        for first, count in _block_runs(block_ids)
        for done in range(0, count, per_chunk)
    ]
    offset = _HEADER_BYTES
    for cache in kv_caches:
        # Bytes of K (row 0) and V (row 1), block after block: a view, no copy.
        rows = cache.view(torch.uint8).numpy().reshape(2, -1)
        for row in rows:
            buffers: list[memoryview] = []
            in_chunk = 0  # blocks
            for first, count in pieces:
                if buffers and (in_chunk + count > per_chunk or len(buffers) == _IOV_MAX):
                    yield offset, buffers, in_chunk * block_bytes
                    offset += in_chunk * block_bytes
                    buffers, in_chunk = [], 0
                buffers.append(memoryview(row[first * block_bytes : (first + count) * block_bytes]))
                in_chunk += count
            if buffers:
                yield offset, buffers, in_chunk * block_bytes
                offset += in_chunk * block_bytes


def _vector_io(io: Callable, fd: int, buffers: list[memoryview], offset: int, num_bytes: int) -> None:
    """`os.preadv` / `os.pwritev` of every byte of `buffers` (a call may move fewer)."""
    while num_bytes:
        moved = io(fd, buffers, offset)
        if moved <= 0:
            raise KVTransferError(f"the transfer file ended {num_bytes} bytes early")
        offset, num_bytes = offset + moved, num_bytes - moved
        while buffers and moved >= len(buffers[0]):
            moved -= len(buffers[0])
            buffers = buffers[1:]
        if moved:
            buffers = [buffers[0][moved:], *buffers[1:]]


def _copy_with_file(
    kv_caches: list[torch.Tensor], block_ids: list[int], path: str, writing: bool, pause: Callable[[], None] | None
) -> None:
    """Write (`writing`) the blocks to the file's data, or read them from it,
    chunk by chunk; `pause` runs between chunks."""
    fd = os.open(path, os.O_WRONLY if writing else os.O_RDONLY)
    try:
        for offset, buffers, num_bytes in _file_chunks(kv_caches, block_ids):
            _vector_io(os.pwritev if writing else os.preadv, fd, buffers, offset, num_bytes)
            if pause is not None:
                pause()
    finally:
        os.close(fd)


def _copy_blocks(
    kv_caches: list[torch.Tensor],
    block_ids: list[int],
    path: str,
    size: int,
    writing: bool,
    pause: Callable[[], None] | None,
) -> None:
    """The blocks into (`writing`) or out of the data part of the file at `path` (`size` bytes)."""
    if _copies_by_file_io(kv_caches):
        _copy_with_file(kv_caches, block_ids, path, writing, pause)
    elif writing:
        _gather(kv_caches, block_ids, _map(path, kv_caches[0].dtype, size, writable=True))
    else:
        _scatter(kv_caches, block_ids, _map(path, kv_caches[0].dtype, size, writable=False))


def _check_header(raw: bytes, size: int, kv_caches: list[torch.Tensor], num_blocks: int, what: str) -> None:
    """Refuse (KVTransferError) a transfer that is not `num_blocks` blocks of this rank's layout."""
    try:
        header = json.loads(bytes(raw).rstrip(b"\0"))
    except ValueError as e:
        raise KVTransferError(f"{what} has no valid header") from e
    if not isinstance(header, dict) or header.get("magic") != _MAGIC or header.get("version") != _VERSION:
        raise KVTransferError(f"{what} is not a raylm KV transfer of version {_VERSION}")
    if header.get("error"):
        raise KVTransferError(f"the source rank could not export {what}: {header['error']}")
    mine = _layout(kv_caches)
    theirs = {key: header.get(key) for key in mine}
    if theirs != mine:
        raise KVTransferError(
            f"KV layouts differ: the source rank holds {theirs}, this rank {mine} "
            "(engines must have the same model, dtype, block size and TP/PP layout)"
        )
    if header.get("num_blocks") != num_blocks:
        raise KVTransferError(f"{what} holds {header.get('num_blocks')} blocks, {num_blocks} were reserved")
    expected = _HEADER_BYTES + _data_bytes(kv_caches, num_blocks)
    if size != expected:
        raise KVTransferError(f"{what} is truncated or padded ({size} bytes, {expected} expected)")


class _SpareFiles:
    """The transfer files this process made, each kept under a second name
    (a hard link) in its folder, so that its pages outlive the transfer: once
    the transfer's own name is unlinked (its link count back to 1), the file
    can be filled again under the next transfer's name, its pages already
    allocated. At most `_MAX_SPARES` per folder, of at most `_MAX_SPARE_BYTES`
    each (a long request's first stage is not held on to); they go with the
    folder (the supervisor removes it at shutdown)."""

    _MAX_SPARES = 2
    _MAX_SPARE_BYTES = 128 << 20

    def __init__(self):
        self._spares: dict[str, list[str]] = {}  # folder -> spare names
        # Files a fill is writing into (inodes): never handed to another transfer
        # meanwhile, even when their transfer was withdrawn (its name unlinked)
        # mid-fill. The lock orders a fill's start against `take`.
        self._filling: set[int] = set()
        self._lock = threading.Lock()

    @contextmanager
    def filling(self, path: str):
        """Around a fill of `path`'s file. FileNotFoundError: the transfer is
        gone (its name unlinked), so nothing is written."""
        with self._lock:
            inode = os.stat(path).st_ino
            self._filling.add(inode)
        try:
            yield
        finally:
            with self._lock:
                self._filling.discard(inode)

    def take(self, path: str, size: int) -> bool:
        """Give a free spare the name `path`, `size` bytes, header blank; False: none free."""
        if size > self._MAX_SPARE_BYTES:
            return False
        with self._lock:
            return self._take(path, size)

    def _take(self, path: str, size: int) -> bool:
        folder = os.path.dirname(path)
        spares = self._spares.get(folder, [])
        for spare in list(spares):
            try:
                stat = os.stat(spare)
                if stat.st_nlink != 1 or stat.st_ino in self._filling:
                    continue  # still named by a transfer in progress, or being written
                fd = os.open(spare, os.O_RDWR)
            except FileNotFoundError:  # its folder went with an engine
                spares.remove(spare)
                continue
            try:
                os.ftruncate(fd, size)
                # Blank before it gets the new name: a reader never sees the last transfer's header.
                os.pwrite(fd, bytes(_HEADER_BYTES), 0)
            finally:
                os.close(fd)
            os.link(spare, path)  # FileExistsError if `path` exists: never read a stale file as this one
            return True
        return False

    def keep(self, path: str, size: int) -> None:
        """Keep the file just made at `path` as a spare, if there is room."""
        folder = os.path.dirname(path)
        spares = self._spares.setdefault(folder, [])
        if len(spares) < self._MAX_SPARES and size <= self._MAX_SPARE_BYTES:
            spare = os.path.join(folder, f"spare-{os.getpid()}-{os.path.basename(path)}")
            os.link(path, spare)
            spares.append(spare)


_spare_files = _SpareFiles()


def create_file(kv_caches: list[torch.Tensor], num_blocks: int, path: str) -> int:
    """Make the file of a transfer of `num_blocks` blocks, its header still
    blank (`fill_file` writes it last); returns its size."""
    if not kv_caches:
        raise KVTransferError("this rank holds no KV cache")
    size = _HEADER_BYTES + _data_bytes(kv_caches, num_blocks)
    if _spare_files.take(path, size):
        return size
    # Created fresh (O_EXCL): a stale file of an earlier transfer is never read as this one.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    _spare_files.keep(path, size)
    return size


def fill_file(
    kv_caches: list[torch.Tensor], block_ids: list[int], path: str, pause: Callable[[], None] | None = None
) -> int:
    """Copy the blocks into a file `create_file` made, then write its header:
    a reader that sees the header sees the data. On failure the header says
    why. `pause`: called between chunks (a paced copy beside the steps)."""
    size = _HEADER_BYTES + _data_bytes(kv_caches, len(block_ids))
    with _spare_files.filling(path):
        try:
            encoded = _header_bytes(kv_caches, len(block_ids))
            if block_ids:
                _copy_blocks(kv_caches, block_ids, path, size, True, pause)
        except Exception as e:
            _write_header(
                path,
                json.dumps({"magic": _MAGIC, "version": _VERSION, "error": f"{type(e).__name__}: {e}"}).encode()[
                    :_HEADER_BYTES
                ],
            )
            raise
        _write_header(path, encoded)
    return size


def _write_header(path: str, encoded: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, encoded, 0)
    finally:
        os.close(fd)


def export_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], path: str) -> int:
    """Write the blocks `block_ids` of every layer to `path`; returns the bytes written."""
    create_file(kv_caches, len(block_ids), path)
    return fill_file(kv_caches, block_ids, path)


def import_blocks(
    kv_caches: list[torch.Tensor],
    block_ids: list[int],
    path: str,
    wait_s: float = 0.0,
    pause: Callable[[], None] | None = None,
    cancelled: threading.Event | None = None,
) -> int:
    """Read a file written by `export_blocks` into the blocks `block_ids`
    (one per exported block, in order); returns the bytes read. `wait_s`:
    how long to wait for a file whose source is still filling it, unless
    `cancelled` is set meanwhile. `pause`: called between chunks (a paced
    copy beside the steps)."""
    if not kv_caches:
        raise KVTransferError("this rank holds no KV cache")
    deadline = time.monotonic() + wait_s
    retry_s = 0.001
    while True:
        try:
            with open(path, "rb") as f:
                raw = f.read(_HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
        except OSError as e:
            raise KVTransferError(f"KV transfer file {path!r} cannot be read: {e}") from e
        if raw[:1] not in (b"", b"\0") or time.monotonic() >= deadline:
            break
        # The source's thread is still filling the file (paced, it may take a
        # while): look again, less often as the wait goes on (each look costs CPU).
        if cancelled is None:
            time.sleep(retry_s)
        elif cancelled.wait(retry_s):
            raise KVTransferError(f"the import of {path!r} was cancelled while it waited for its source")
        retry_s = min(2 * retry_s, _MAX_RETRY_S)
    _check_header(raw, size, kv_caches, len(block_ids), f"KV transfer file {path!r}")
    if block_ids:
        _copy_blocks(kv_caches, block_ids, path, size, False, pause)
    return size


def packed_size(kv_caches: list[torch.Tensor], num_blocks: int) -> int:
    return _HEADER_BYTES + _data_bytes(kv_caches, num_blocks)


def pack_blocks(
    kv_caches: list[torch.Tensor],
    block_ids: list[int],
    pause: Callable[[], None] | None = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same bytes `export_blocks` writes to a file, in memory (a flat
    uint8 tensor): what a rank sends to another node (raylm.kv_transfer.network).
    `pause`: called after each layer (a paced copy beside the steps).
    `into`: a flat uint8 buffer at least that large to pack into (the result
    is its start); None: a new one."""
    if not kv_caches:
        raise KVTransferError("this rank holds no KV cache")
    encoded = _header_bytes(kv_caches, len(block_ids))
    size = _HEADER_BYTES + _data_bytes(kv_caches, len(block_ids))
    if into is not None and (into.dtype != torch.uint8 or into.dim() != 1 or into.numel() < size):
        raise ValueError(f"cannot pack {size} bytes into a buffer of {into.numel()} {into.dtype}")
    packed = torch.empty(size, dtype=torch.uint8) if into is None else into[:size]
    # The header's room is zeros after the header, as in a file; the blocks
    # overwrite every byte after it.
    packed[:_HEADER_BYTES].zero_()
    packed[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    if block_ids:
        _gather(kv_caches, block_ids, packed[_HEADER_BYTES:].view(kv_caches[0].dtype), pause)
    return packed


def unpack_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], packed, what: str, pause: Callable[[], None] | None = None
) -> int:
    """Read what `pack_blocks` made (any buffer: bytes, a ZMQ frame's memoryview)
    into the blocks `block_ids`; returns its size in bytes. `pause`: as for
    `pack_blocks`."""
    if not kv_caches:
        raise KVTransferError("this rank holds no KV cache")
    view = memoryview(packed).cast("B")
    _check_header(view[:_HEADER_BYTES], len(view), kv_caches, len(block_ids), what)
    if block_ids:
        with warnings.catch_warnings():
            # A received frame is read-only; it is only read here.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            data = torch.frombuffer(view, dtype=kv_caches[0].dtype, offset=_HEADER_BYTES)
        _scatter(kv_caches, block_ids, data, pause)
    return len(view)


def _map(path: str, dtype: torch.dtype, size: int, writable: bool) -> torch.Tensor:
    """The data part of the file as a flat tensor of `dtype`, mapped (no copy;
    the tensor keeps the mapping alive). Populated at once: one call maps
    every page, where touching them would fault once per page."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        mapping = mmap.mmap(
            fd,
            size,
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0),
        )
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # A read-only mapping is only read here.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=dtype, offset=_HEADER_BYTES)
