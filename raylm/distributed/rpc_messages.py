"""The envelopes of calls over the step queues (raylm.executor.mq_rpc): a
request broadcast to every rank, each rank's reply, and the record an
exception travels as.

They live here, below the executor, because the message codec must know them:
every type that crosses a queue is declared to it (raylm.distributed.message_codec).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass
class CallableRef:
    """A callable the driver registered on every worker through Ray before the
    call (see RayWorkerWrapper.register_rpc_callable): the queue carries only
    this token, never the code."""

    token: int
    # The callable's name, for error messages on both sides.
    name: str


# The two envelopes are NamedTuples: one of each per step, and a tuple is the
# cheapest object to build on decode (DEFAULT_RECORD_TYPES in the codec).
class RpcRequest(NamedTuple):
    seq: int
    # A worker method's name; a CallableRef; or, on a local shared-memory
    # queue only (the multiprocess executor), the callable itself.
    method: str | CallableRef | Callable
    args: tuple
    kwargs: dict[str, Any]
    # None: every rank replies; else only this rank does (the others report failures).
    reply_rank: int | None


@dataclass
class RemoteError:
    """An exception raised on a worker, as plain text: the driver re-raises it
    as its own error type (it never rebuilds the worker's exception object)."""

    type_name: str
    message: str
    traceback: str
    rank: int
    method: str


class RpcReply(NamedTuple):
    seq: int
    # "ok" (payload: the method's return value), "error" (payload: a
    # RemoteError), or "fatal" (a RemoteError that makes the executor unusable).
    status: str
    payload: Any
