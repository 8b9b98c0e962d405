"""The PP x CP x TP mesh: which ranks form which group, in one place.

Ranks are laid out with TP fastest, then CP, then PP:

    global rank = (pp_rank * cp_size + cp_rank) * tp_size + tp_rank

so the ranks of one TP group are adjacent, and the CP groups of one pipeline
stage (one per tp_rank, members tp_size apart) lie inside the stage's block of
cp_size * tp_size consecutive ranks, which the executor places on one node
whenever the cluster allows. A CP (context-parallel) group holds the shards of
every sequence's KV cache (raylm.model.layers.attention) and merges its
members' partial attention each layer.

On CPU, a TP or CP group whose ranks share a node all-reduces and all-gathers
through shared memory (shm_collective), falling back to gloo for tensors too
large for its slots; groups spanning nodes use gloo, and CUDA groups NCCL.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raylm.distributed.shm_collective import ShmCommunicator, create_shm_communicator


@dataclass
class GroupCoordinator:
    """One process group plus this process's place in it."""

    ranks: list[int]
    rank_in_group: int
    group: dist.ProcessGroup | None
    shm: ShmCommunicator | None = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        if self.shm is not None and self.shm.can_carry(tensor):
            return self.shm.all_reduce(tensor)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim` (same shape on all ranks)."""
        if self.world_size == 1:
            return tensor
        if self.shm is not None and self.shm.can_carry(tensor):
            return self.shm.all_gather(tensor, dim=dim)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def send(self, tensor: torch.Tensor, dst_in_group: int) -> None:
        dist.send(tensor.contiguous(), dst=self.ranks[dst_in_group], group=self.group)

    def recv(self, tensor: torch.Tensor, src_in_group: int) -> torch.Tensor:
        dist.recv(tensor, src=self.ranks[src_in_group], group=self.group)
        return tensor

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
_CP: GroupCoordinator | None = None
# The timeout the global group was created with; subgroups and the shared-
# memory collective take the same, so no wait on a dead peer is unbounded.
_TIMEOUT: datetime.timedelta | None = None


def _single() -> GroupCoordinator:
    return GroupCoordinator(ranks=[0], rank_in_group=0, group=None)


def global_rank(tp_rank: int, pp_rank: int, cp_rank: int, tp_size: int, cp_size: int = 1) -> int:
    return (pp_rank * cp_size + cp_rank) * tp_size + tp_rank


def rank_coordinates(rank: int, tp_size: int, cp_size: int = 1) -> tuple[int, int, int]:
    """(tp_rank, pp_rank, cp_rank) of a global rank."""
    return rank % tp_size, rank // (tp_size * cp_size), rank // tp_size % cp_size


def tp_group_ranks(tp_size: int, pp_size: int, cp_size: int = 1) -> list[list[int]]:
    """One group per (pp, cp) slot, in that order."""
    return [
        [global_rank(tp, pp, cp, tp_size, cp_size) for tp in range(tp_size)]
        for pp in range(pp_size)
        for cp in range(cp_size)
    ]


def pp_group_ranks(tp_size: int, pp_size: int, cp_size: int = 1) -> list[list[int]]:
    """One group per (cp, tp) slot."""
    return [
        [global_rank(tp, pp, cp, tp_size, cp_size) for pp in range(pp_size)]
        for cp in range(cp_size)
        for tp in range(tp_size)
    ]


def cp_group_ranks(tp_size: int, pp_size: int, cp_size: int = 1) -> list[list[int]]:
    """One group per (pp, tp) slot."""
    return [
        [global_rank(tp, pp, cp, tp_size, cp_size) for cp in range(cp_size)]
        for pp in range(pp_size)
        for tp in range(tp_size)
    ]


# An init_method naming a rendezvous store its launcher already serves
# (`host_rendezvous_store`): no rank binds a port of its own. With
# tcp://host:port rank 0 binds a port its launcher found free moments
# before, which something else may have taken meanwhile.
_HOSTED_STORE_SCHEME = "raylm-store://"


def host_rendezvous_store(timeout_s: float) -> tuple[dist.TCPStore, str]:
    """A rendezvous store served by this process on a port the OS picks, and
    the init_method that sends the ranks to it; keep the store alive until
    the ranks are gone (their process group uses it to make its subgroups)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return store, f"{_HOSTED_STORE_SCHEME}127.0.0.1:{store.port}"


def init_distributed_environment(
    world_size: int, rank: int, init_method: str, backend: str, timeout_s: float | None = None
) -> None:
    """Join the global process group (a no-op for a single process).

    `timeout_s` bounds the rendezvous (a peer that never comes up) and every
    later collective of the group (a peer that hangs), instead of torch's 30
    minutes; the engine's step deadline is the same order of magnitude."""
    global _TIMEOUT
    if world_size == 1 or dist.is_initialized():
        return
    _TIMEOUT = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    kwargs = {} if _TIMEOUT is None else {"timeout": _TIMEOUT}
    if init_method.startswith(_HOSTED_STORE_SCHEME):
        host, port = init_method[len(_HOSTED_STORE_SCHEME) :].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), None, is_master=False, **kwargs)
        dist.init_process_group(backend=backend, store=store, world_size=world_size, rank=rank, **kwargs)
        return
    dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank, **kwargs)


def initialize_model_parallel(tp_size: int = 1, pp_size: int = 1, backend: str | None = None, cp_size: int = 1) -> None:
    """Build the TP, PP and CP groups. Every rank must call this with the same sizes:
    `new_group` is collective, and creating groups in different orders deadlocks."""
    global _TP, _PP, _CP
    for coordinator in (_TP, _PP, _CP):
        if coordinator is not None:
            coordinator.close()
    if tp_size * pp_size * cp_size == 1:
        _TP, _PP, _CP = _single(), _single(), _single()
        return
    rank = dist.get_rank()
    if dist.get_world_size() != tp_size * pp_size * cp_size:
        raise ValueError(
            f"world size {dist.get_world_size()} != tensor_parallel_size {tp_size} "
            f"x pipeline_parallel_size {pp_size} x context_parallel_size {cp_size}"
        )
    mine = {}
    # Same order on every rank (TP, PP, CP; groups in list order): see above.
    for kind, layout in (("tp", tp_group_ranks), ("pp", pp_group_ranks), ("cp", cp_group_ranks)):
        for ranks in layout(tp_size, pp_size, cp_size):
            group = dist.new_group(ranks, backend=backend, timeout=_TIMEOUT)
            if rank in ranks:
                mine[kind] = GroupCoordinator(ranks, ranks.index(rank), group)
    _TP, _PP, _CP = mine["tp"], mine["pp"], mine["cp"]
    # Collectives over the TP group, then the CP group (gloo, three small
    # messages each), so they run once every world-wide new_group call is
    # done; a rank belongs to one group of each kind, and every rank does TP
    # before CP, so no member waits on a peer busy with the other group.
    timeout_s = (_TIMEOUT or dist.default_pg_timeout).total_seconds()
    for coordinator in (_TP, _CP):
        if coordinator.world_size > 1 and dist.get_backend(coordinator.group) == "gloo":
            coordinator.shm = create_shm_communicator(
                coordinator.group, coordinator.ranks, coordinator.rank_in_group, timeout_s
            )


def get_tp_group() -> GroupCoordinator:
    return _TP if _TP is not None else _single()


def get_pp_group() -> GroupCoordinator:
    return _PP if _PP is not None else _single()


def get_cp_group() -> GroupCoordinator:
    return _CP if _CP is not None else _single()


def destroy_model_parallel() -> None:
    global _TP, _PP, _CP, _TIMEOUT
    for coordinator in (_TP, _PP, _CP):
        if coordinator is not None:
            coordinator.close()
    _TP = _PP = _CP = None
    _TIMEOUT = None
    if dist.is_initialized():
        dist.destroy_process_group()
