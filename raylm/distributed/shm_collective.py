"""ShmCommunicator: all-reduce and all-gather between the ranks of one group that
share a node, through a POSIX shared-memory segment instead of gloo.

gloo moves every tensor over loopback TCP, which costs tens of microseconds per
call; a TP decode step makes two all-reduces per layer, on tensors of a few KB.
Here each rank copies its tensor into its own slot of a shared segment, raises
its counter, waits for its peers' counters and reads their slots directly.

Segment layout (``raylm_coll_<pid>_<hex>``, in /dev/shm only until every rank
has mapped it; the creator unlinks it then, so a killed process leaves nothing)::

    [counters: one int64 per rank, each on its own cache line]    world * 64 B
    [padding to a page]
    [buffer 0: one slot of slot_bytes per rank]
    [buffer 1: likewise]

Protocol. Every rank makes the same sequence of collective calls (the contract
of any collective). For its n-th call (n = 1, 2, ...) rank r
  (1) copies its input into slot r of buffer n % 2,
  (2) stores n into counter r,
  (3) waits until every counter is >= n,
  (4) reads all slots of buffer n % 2 into private memory, and returns.

Why it is safe:
- A rank reads complete data: when r reads slot q at (4), counter q >= n, and q
  stored it at (2) only after writing its call-n data at (1).
- Nobody overwrites a slot still being read: q next writes slot q of buffer
  n % 2 in call n + 2, which needs q to pass (3) of call n + 1, which needs
  counter r >= n + 1, which r stores only after finishing its reads (4) of
  call n. Call n + 1 uses the other buffer, so q running one call ahead is
  harmless, and q can never be two calls ahead.
- Counters only grow, so `>= n` never becomes false once true.
The argument needs stores to become visible in program order, loads not to be
reordered with earlier loads, and a load to finish before a later store. x86
guarantees all three (TSO); weaker memory models would need fences that Python
cannot issue, so the communicator is only offered on x86-64.

Every rank sums the slots in rank order with the same torch ops, so all ranks
hold bit-identical results; half-precision inputs are summed in fp32 and cast
once, as gloo does for two ranks.
"""

from __future__ import annotations

import _posixshmem
import logging
import mmap
import os
import platform
import secrets
import socket
import time
from multiprocessing import resource_tracker

import numpy as np
import torch
import torch.distributed as dist

from raylm.distributed.shm_ring import unlink_segment

logger = logging.getLogger(__name__)

DISABLE_ENV = "RAYLM_DISABLE_SHM_COLLECTIVE"
SEGMENT_PREFIX = "raylm_coll_"
# Decode-sized messages (a few thousand tokens x hidden in bf16, logits of small
# batches) fit; bigger ones, mostly prefill, are compute-bound and go to gloo.
# Pages are only backed once touched, so an unused slot costs no memory.
DEFAULT_SLOT_BYTES = 16 << 20

_CACHE_LINE = 64
_PAGE = 4096
_NUM_BUFFERS = 2
_HALF_DTYPES = (torch.bfloat16, torch.float16)

# Waiting: spin first (a peer usually arrives within microseconds), then yield
# the core (on a small machine the peer we wait for may need it), then sleep
# with doubling intervals so a long wait costs almost no CPU.
_SPIN_S = 20e-6
_YIELD_S = 2e-3
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 1e-3


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def node_identity() -> tuple[str, str]:
    """What tells two processes apart as being on different machines."""
    return socket.gethostname(), _boot_id()


def shm_collective_wanted() -> bool:
    return os.environ.get(DISABLE_ENV, "") != "1" and platform.machine() in ("x86_64", "AMD64")


def _segment_size(world_size: int, slot_bytes: int) -> tuple[int, int]:
    """(offset of the first buffer, total size)."""
    data_offset = -(-world_size * _CACHE_LINE // _PAGE) * _PAGE
    return data_offset, data_offset + _NUM_BUFFERS * world_size * slot_bytes


def _map_segment(name: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
    try:
        if create:
            os.ftruncate(fd, size)  # zero-filled: every counter starts at 0
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class ShmCommunicator:
    """All-reduce / all-gather for `world_size` ranks mapping one segment.

    Build it with `create_shm_communicator`, which agrees on the segment over
    the group's gloo connection. Callers check `can_carry(tensor)` first and use
    gloo when it says no; the answer depends only on shape, dtype and device,
    which every rank of a collective shares, so all ranks take the same path.
    """

    def __init__(self, mapping: mmap.mmap, rank: int, world_size: int, slot_bytes: int, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._mmap = mapping
        data_offset, _ = _segment_size(world_size, slot_bytes)
        # numpy for the counters: a single aligned int64 load/store is one
        # machine instruction, and far cheaper from Python than a torch index.
        self._counters = np.ndarray((world_size,), dtype=np.int64, buffer=mapping, offset=0, strides=(_CACHE_LINE,))
        self._buffers = [
            torch.frombuffer(
                mapping,
                dtype=torch.uint8,
                offset=data_offset + b * world_size * slot_bytes,
                count=world_size * slot_bytes,
            ).view(world_size, slot_bytes)
            for b in range(_NUM_BUFFERS)
        ]
        self._peers = [q for q in range(world_size) if q != rank]
        self._calls = 0
        self._broken: str | None = None

    # ---- public -------------------------------------------------------------------

    def can_carry(self, tensor: torch.Tensor) -> bool:
        return (
            self._mmap is not None
            and tensor.device.type == "cpu"
            and tensor.numel() * tensor.element_size() <= self.slot_bytes
            and (tensor.dtype.is_floating_point or tensor.dtype in (torch.int32, torch.int64))
        )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, written into `tensor` (as dist.all_reduce does) and returned."""
        views = self._exchange(tensor, "all_reduce")
        if tensor.dtype in _HALF_DTYPES:
            total = views[0].float()
            for view in views[1:]:
                total += view
            tensor.copy_(total)
        else:
            torch.add(views[0], views[1], out=tensor)
            for view in views[2:]:
                tensor += view
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all ranks) concatenated along `dim`."""
        return torch.cat(self._exchange(tensor, "all_gather"), dim=dim)

    def close(self) -> None:
        """Unmap. Idempotent; the segment itself was unlinked at creation."""
        if self._mmap is None:
            return
        mapping, self._mmap = self._mmap, None
        self._counters = None
        self._buffers = []
        try:
            mapping.close()
        except BufferError:
            # A view is still alive somewhere (a frame of a failed call); the
            # mapping goes when it does.
            pass

    # ---- protocol -----------------------------------------------------------------

    def _exchange(self, tensor: torch.Tensor, op: str) -> list[torch.Tensor]:
        """Steps (1)-(3) of the protocol; returns views of every rank's slot. The
        views stay valid until this rank's next call returns (see the proof)."""
        if self._broken is not None:
            raise RuntimeError(f"shared-memory collective unusable after an earlier failure: {self._broken}")
        if not self.can_carry(tensor):
            raise ValueError(
                f"tensor of {tensor.numel() * tensor.element_size()} bytes ({tensor.dtype}, "
                f"{tensor.device}) does not fit a {self.slot_bytes}-byte slot; check can_carry"
            )
        self._calls += 1
        n = self._calls
        buffer = self._buffers[n % _NUM_BUFFERS]
        nbytes = tensor.numel() * tensor.element_size()
        views = [buffer[q, :nbytes].view(tensor.dtype).view(tensor.shape) for q in range(self.world_size)]
        views[self.rank].copy_(tensor)
        self._counters[self.rank] = n
        self._wait_for_peers(n, op)
        return views

    def _wait_for_peers(self, n: int, op: str) -> None:
        counters = self._counters
        pending = [q for q in self._peers if counters[q] < n]
        if not pending:
            return
        start = time.perf_counter()
        deadline = start + self.timeout_s
        sleep_s = _FIRST_SLEEP_S
        while True:
            pending = [q for q in pending if counters[q] < n]
            if not pending:
                return
            now = time.perf_counter()
            if now - start < _SPIN_S:
                continue
            if now >= deadline:
                self._broken = (
                    f"{op} call {n} on rank {self.rank} waited {self.timeout_s:g} s for rank(s) "
                    f"{pending} of its group (died or hung)"
                )
                raise TimeoutError(f"shared-memory {self._broken}")
            if now - start < _YIELD_S:
                os.sched_yield()
            else:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)


def create_shm_communicator(
    group: dist.ProcessGroup,
    ranks: list[int],
    rank_in_group: int,
    timeout_s: float,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
) -> ShmCommunicator | None:
    """Collective over `group` (every member must call it): a communicator when
    every member is on this node, wants one and could map the segment, else
    None on every member, and the caller keeps gloo.

    The group's first rank creates the segment; its name travels over gloo.
    Deadlock note: every member runs the same three gloo collectives in the
    same order whatever happens locally, so no member can be left waiting."""
    world_size = len(ranks)
    slot_bytes = -(-slot_bytes // _CACHE_LINE) * _CACHE_LINE
    identities: list = [None] * world_size
    dist.all_gather_object(identities, (shm_collective_wanted(), node_identity()), group=group)
    if not all(wanted for wanted, _ in identities) or len({ident for _, ident in identities}) != 1:
        return None

    _, size = _segment_size(world_size, slot_bytes)
    created, mapping = _create_segment(size) if rank_in_group == 0 else (None, None)
    try:
        announced = [created]
        dist.broadcast_object_list(announced, src=ranks[0], group=group)
        name = announced[0]
        if name is None:
            return None
        if rank_in_group != 0:
            mapping = _attach_segment(name, size)
        attached: list = [None] * world_size
        dist.all_gather_object(attached, mapping is not None, group=group)
    finally:
        # Every member has mapped it, given up or failed: the name is no longer
        # needed, and the mappings keep the memory alive.
        if created is not None:
            unlink_segment(created)
    if not all(attached):
        if mapping is not None:
            mapping.close()
        logger.warning("shared-memory collective: a rank could not map %s; using gloo", name)
        return None
    if rank_in_group == 0:
        logger.info(
            "TP ranks %s all-reduce/all-gather through shared memory (%d-byte slots; larger via gloo)",
            ranks,
            slot_bytes,
        )
    return ShmCommunicator(mapping, rank_in_group, world_size, slot_bytes, timeout_s)


def _create_segment(size: int) -> tuple[str | None, mmap.mmap | None]:
    try:
        stat = os.statvfs("/dev/shm")
        if stat.f_bavail * stat.f_frsize < size:
            # Touching pages past a full tmpfs is a SIGBUS, not an exception.
            logger.warning("shared-memory collective: /dev/shm has less than %d bytes free; using gloo", size)
            return None, None
        name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        mapping = _map_segment(name, size, create=True)
    except OSError as e:
        logger.warning("shared-memory collective: cannot create a segment (%s); using gloo", e)
        return None, None
    # Until the peers have attached and we unlink it, the resource tracker
    # removes the segment if this process is killed.
    resource_tracker.register("/" + name, "shared_memory")
    return name, mapping


def _attach_segment(name: str, size: int) -> mmap.mmap | None:
    try:
        return _map_segment(name, size, create=False)
    except OSError as e:
        logger.warning("shared-memory collective: cannot open segment %s (%s)", name, e)
        return None
