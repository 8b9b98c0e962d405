"""The TP x PP mesh: which ranks form which group, in one place.

Ranks are laid out with TP fastest: global rank = pp_rank * tp_size + tp_rank,
so the ranks of one TP group are adjacent (and placed on one node by the
executor whenever the cluster allows).
"""

from __future__ import annotations

import datetime

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    """One process group plus this process's place in it."""

    ranks: list[int]
    rank_in_group: int
    group: "dist.ProcessGroup | None"

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
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim` (same shape on all ranks)."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def send(self, tensor: torch.Tensor, dst_in_group: int) -> None:
        dist.send(tensor.contiguous(), dst=self.ranks[dst_in_group], group=self.group)

    def recv(self, tensor: torch.Tensor, src_in_group: int) -> torch.Tensor:
        dist.recv(tensor, src=self.ranks[src_in_group], group=self.group)
        return tensor


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


def _single() -> GroupCoordinator:
    return GroupCoordinator(ranks=[0], rank_in_group=0, group=None)


def tp_group_ranks(tp_size: int, pp_size: int) -> list[list[int]]:
    return [[pp * tp_size + tp for tp in range(tp_size)] for pp in range(pp_size)]


def pp_group_ranks(tp_size: int, pp_size: int) -> list[list[int]]:
    return [[pp * tp_size + tp for pp in range(pp_size)] for tp in range(tp_size)]


def init_distributed_environment(
    world_size: int, rank: int, init_method: str, backend: str, timeout_s: float | None = None
) -> None:
    """Join the global process group (a no-op for a single process).

    `timeout_s` bounds the rendezvous (a peer that never comes up) and every
    later collective of the group (a peer that hangs), instead of torch's 30
    minutes; the engine's step deadline is the same order of magnitude."""
    if world_size == 1 or dist.is_initialized():
        return
    kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank, **kwargs)


def initialize_model_parallel(tp_size: int = 1, pp_size: int = 1, backend: str | None = None) -> None:
    """Build the TP and PP groups. Every rank must call this with the same sizes:
    `new_group` is collective, and creating groups in different orders deadlocks."""
    global _TP, _PP
    if tp_size * pp_size == 1:
        _TP, _PP = _single(), _single()
        return
    rank = dist.get_rank()
    if dist.get_world_size() != tp_size * pp_size:
        raise ValueError(
            f"world size {dist.get_world_size()} != tensor_parallel_size {tp_size} "
            f"x pipeline_parallel_size {pp_size}"
        )
    for ranks in tp_group_ranks(tp_size, pp_size):
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            _TP = GroupCoordinator(ranks, ranks.index(rank), group)
    for ranks in pp_group_ranks(tp_size, pp_size):
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            _PP = GroupCoordinator(ranks, ranks.index(rank), group)


def get_tp_group() -> GroupCoordinator:
    return _TP if _TP is not None else _single()


def get_pp_group() -> GroupCoordinator:
    return _PP if _PP is not None else _single()


def destroy_model_parallel() -> None:
    global _TP, _PP
    _TP = _PP = None
    if dist.is_initialized():
        dist.destroy_process_group()
