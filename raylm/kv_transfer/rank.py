"""A rank's side of K/V transfers: the one object the worker's transfer
methods (kv_export, kv_import, kv_copies_done, kv_cancel, kv_withdraw; see
raylm.kv_transfer.transport) dispatch to. Each route names its kind, and
the kind's RankTransport does the rank's part: the files in shared memory
(raylm.kv_transfer.files) or the sealed network (raylm.kv_transfer.network).
The copies beside the steps are every kind's (raylm.kv_transfer.background):
an import is run there under its stage's name, which `copies_done` and
`cancel` take.
"""

from __future__ import annotations

import abc
import functools

import torch

from raylm.kv_transfer import files
from raylm.kv_transfer.background import KVCopyJobs
from raylm.kv_transfer.frames import FETCH_TIMEOUT_S, FINAL_FETCH_TIMEOUT_S
from raylm.kv_transfer.network import KVNetworkEndpoint
from raylm.kv_transfer.sealed_frames import TransferKey
from raylm.kv_transfer.transport import stage_name


class RankTransport(abc.ABC):
    """A transfer kind's part on one rank (registered in `_KINDS` under the
    engine side's `kind`): `export` and `import_` are what each kind must
    define."""

    def __init__(self, transfers: RankTransfers):
        self.transfers = transfers

    @abc.abstractmethod
    def export(self, kv_caches: list[torch.Tensor], route: dict, block_ids: list[int], background: bool) -> list:
        """This rank's shard of `block_ids`; [bytes, address to fetch from or None]."""

    @abc.abstractmethod
    def import_(self, kv_caches: list[torch.Tensor], route: dict, block_ids: list[int], background: bool) -> int | None:
        """The same source rank's shard into `block_ids`; the bytes, or None
        when `background` (handed to the copy threads under the stage's name)."""

    def withdraw(self, route: dict, prefix: str) -> int:
        """Drop what this rank still offers under names starting with `prefix`."""
        return 0

    def close(self) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        pass


class FileRank(RankTransport):
    """Each rank writes, and reads, its own file of the stage (`<prefix>.rank<i>`)."""

    def export(self, kv_caches, route, block_ids, background):
        path = files.rank_path(route["path_prefix"], self.transfers.rank)
        if not background:
            return [files.export_blocks(kv_caches, block_ids, path), None]
        # Made now, filled by a thread beside the steps: the size is known at once.
        size = files.create_file(kv_caches, len(block_ids), path)
        self.transfers.copies().export(files.fill_file, kv_caches, block_ids, path, paced=True)
        return [size, None]

    def import_(self, kv_caches, route, block_ids, background):
        path = files.rank_path(route["path_prefix"], self.transfers.rank)
        if not background:
            return files.import_blocks(kv_caches, block_ids, path)
        # Beside the steps, waiting for the source to fill the file.
        self.transfers.copies().import_(
            stage_name(route["path_prefix"]),
            files.import_blocks,
            kv_caches,
            block_ids,
            path,
            FETCH_TIMEOUT_S,
            paced=True,
        )
        return None


class NetworkRank(RankTransport):
    """The source rank offers its shard on its node's address (its server,
    started by the first export, remade if the supervisor's key changes); the
    destination's same rank fetches it from `sources[rank]`."""

    def __init__(self, transfers: RankTransfers):
        super().__init__(transfers)
        self.endpoint: KVNetworkEndpoint | None = None  # started by the first export

    def export(self, kv_caches, route, block_ids, background):
        if self.endpoint is None:
            self.endpoint = KVNetworkEndpoint()
        # `background`: packed by a thread beside the steps (a fetch waits for it).
        pack = self._paced_export if background else None
        num_bytes, address = self.endpoint.serve(
            kv_caches, self._name(route), block_ids, route["host"], TransferKey(route["key"]), pack, route["peer"]
        )
        return [num_bytes, address]

    def import_(self, kv_caches, route, block_ids, background):
        # From this node's address: the only one the source's server admits.
        fetch = functools.partial(KVNetworkEndpoint().fetch_into, local=route["peer"])
        args = (
            kv_caches,
            self._name(route),
            block_ids,
            route["sources"][self.transfers.rank],
            TransferKey(route["key"]),
        )
        if not background:
            return fetch(*args, FINAL_FETCH_TIMEOUT_S)
        self.transfers.copies().import_(route["name"], fetch, *args, paced=True)
        return None

    def withdraw(self, route, prefix):
        return self.endpoint.withdraw(prefix) if self.endpoint is not None else 0

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    def _name(self, route: dict) -> str:
        return f"{route['name']}.rank{self.transfers.rank}"

    def _paced_export(self, fn, *args):
        """An offer's packing beside the steps, paced as a file's filling."""
        return self.transfers.copies().export(fn, *args, paced=True)


_KINDS: dict[str, type[RankTransport]] = {"files": FileRank, "network": NetworkRank}


class RankTransfers:
    """Everything one rank holds for K/V transfers: a RankTransport per kind
    (made at its first use) and the copies beside the steps."""

    def __init__(self, rank: int):
        self.rank = rank
        self._kinds: dict[str, RankTransport] = {}
        self._copies: KVCopyJobs | None = None

    def kind(self, route: dict) -> RankTransport:
        kind = route["kind"]
        if kind not in self._kinds:
            self._kinds[kind] = _KINDS[kind](self)
        return self._kinds[kind]

    def copies(self) -> KVCopyJobs:
        if self._copies is None:
            self._copies = KVCopyJobs()
        return self._copies

    @property
    def network(self) -> KVNetworkEndpoint | None:
        """The rank's network endpoint, once an export started it."""
        rank = self._kinds.get("network")
        return rank.endpoint if isinstance(rank, NetworkRank) else None

    # ---- what the worker's methods call -------------------------------------------------

    def export(self, kv_caches, route: dict, block_ids: list[int], background: bool = False) -> list:
        return self.kind(route).export(kv_caches, route, block_ids, background)

    def import_(self, kv_caches, route: dict, block_ids: list[int], background: bool = False) -> int | None:
        return self.kind(route).import_(kv_caches, route, block_ids, background)

    def copies_done(self, names: list[str]) -> dict:
        return self.copies().finished(names)

    def cancel(self, names: list[str]) -> None:
        if self._copies is not None:
            self._copies.cancel(names)

    def withdraw(self, route: dict, prefix: str) -> int:
        return self.kind(route).withdraw(route, prefix)

    def close(self) -> None:
        if self._copies is not None:
            self._copies.close()
            self._copies = None
        for kind in self._kinds.values():
            kind.close()
        self._kinds.clear()
