"""A K/V server's sends (raylm.kv_transfer.server): one stage on its way to
a destination, a frame per message sealed just before it goes (`StageSend`),
and the thread that tells the server when a paced frame has left
(`SentFrames`). Apart from the server, which decides what to send and when
it listens; these only send."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch
import zmq

from raylm.kv_transfer import frames
from raylm.kv_transfer.background import (
    CopyBudget,
    CPUAllowance,
    no_wakeup_preemption,
)
from raylm.kv_transfer.frames import (
    _CANCEL_CHECK_S,
    _FRAME_META,
    _STATUS_FAILED,
    _STATUS_OK,
    _STATUS_SEAL_INDEX,
    FETCH_TIMEOUT_S,
    StageBuffers,
    _Wakeup,
)
from raylm.kv_transfer.sealed_frames import AnswerSeal
from raylm.thread_accounting import name_this_thread

# What a server's I/O threads may charge the copy budget for each MiB of
# frames they send: they also accept and refuse every stranger's connection,
# which is no copy's work. Sending costs them 0.16-0.41 ms a MiB over
# loopback (4 runs of 128 MiB, the 2-core AMD EPYC VM); more than this is
# the refusals' (counted in CPUAllowance.excess_s).
_SEND_CPU_PER_MIB_S = 0.5e-3


class StageSend:
    """One stage on its way to a destination, a frame per message, each
    sealed for the request it answers just before it goes. A final stage
    goes at once (its request is paused). A pre-copy stage goes a frame at a
    time: the next once the last one has been sent (its tracker done: libzmq
    has written it to the socket, on the I/O thread's clock) and the
    process's copy budget allows, so that sealing and sending, with the
    packing and the rest of the process's copies, stay within their CPU
    share (sent in one burst, a 2k-token stage made the destination's steps
    4-22% slower over its pre-copy on the two-host benchmark). The
    destination paces its reading by its own budget, which holds the frames
    back here (its socket's queue full, then TCP's window)."""

    def __init__(
        self,
        identity: bytes,
        seal: AnswerSeal,
        packed: torch.Tensor | Future,
        buffer: torch.Tensor | None,
        buffers: StageBuffers,
        budget: CopyBudget | None = None,
        sent_frames: SentFrames | None = None,
        io_allowance: CPUAllowance | None = None,
    ):
        self.identity = identity
        self._io_allowance = io_allowance  # what the I/O threads may charge the budget for sending
        self._seal = seal
        self._packed = packed
        self._buffer, self._buffers = buffer, buffers
        self._sealed: torch.Tensor | None = None  # the frames sealed, from `buffers` too
        self._budget = budget  # None: unpaced
        self._sent_frames = sent_frames  # a paced send's: wakes the server once a frame has gone
        self._chunks: list | None = None  # the frames' arrays, once packed
        self._sealed_frames: list[int] = []  # their sealed sizes
        self._next = 0
        # The sent frames' trackers (a frame object kept here would hold its
        # message: its tracker is done only once libzmq and the frame let go).
        self._sent: list[zmq.MessageTracker] = []
        self._last_sent_at = 0.0
        # Every frame's tracker once all are sent (done: the stage has left); None until then,
        # or for a stage that failed.
        self.sending: zmq.MessageTracker | None = None

    def due_in(self) -> float:
        """Seconds until `advance` may have something to send; math.inf:
        not before the server is woken (its packing ends, its last frame goes)."""
        if self._chunks is None:
            return 0.0 if not isinstance(self._packed, Future) or self._packed.done() else math.inf
        if self._budget is None:
            return 0.0
        if self._sent and not self._sent[-1].done:
            return math.inf
        return self._budget.wait_s()

    def stalled(self, now: float) -> bool:
        """A paced frame not taken for FETCH_TIMEOUT_S: its destination has
        stopped reading (hung; one that died closes its connection, which
        ends the send)."""
        return (
            self._budget is not None
            and bool(self._sent)
            and not self._sent[-1].done
            and now - self._last_sent_at > FETCH_TIMEOUT_S
        )

    def advance(self, sock: zmq.Socket) -> bool:
        """Send what is due; True once the stage has gone (or failed)."""
        if self._chunks is None:
            if isinstance(self._packed, Future):
                if not self._packed.done():
                    return False
                error = self._packed.exception()
                if error is not None:  # the packing failed: the destination says why
                    reason = f"{type(error).__name__}: {error}".encode()
                    sock.send_multipart(
                        [self.identity, _STATUS_FAILED, self._seal.seal(_STATUS_SEAL_INDEX, _STATUS_FAILED, reason)]
                    )
                    self._finish(None)
                    return True
                self._packed = self._packed.result()
            data = self._packed.numpy()
            self._chunks = [data[at : at + frames._FRAME_BYTES] for at in range(0, len(data), frames._FRAME_BYTES)]
            # Frame i sealed at i * (its sealed size): all but the last are full.
            self._sealed_frames = [AnswerSeal.sealed_size(len(chunk)) for chunk in self._chunks]
            self._sealed = self._buffers.take(sum(self._sealed_frames))
        while self._next < len(self._chunks) and self.due_in() <= 0:
            index, chunk = self._next, self._chunks[self._next]
            header = _FRAME_META.pack(index, len(self._chunks))
            at = index * self._sealed_frames[0]
            sealed = self._sealed.numpy()[at : at + self._sealed_frames[index]]
            self._seal.seal_into(index, _STATUS_OK + header, chunk, sealed)
            # Zero-copy: ZMQ holds the frame until it is sent, which its tracker tells.
            frame = zmq.Frame(sealed, copy=False, track=True)
            sock.send_multipart([self.identity, _STATUS_OK, header, frame], copy=False)
            if self._io_allowance is not None:
                self._io_allowance.allow(_SEND_CPU_PER_MIB_S * len(sealed) / (1 << 20))
            self._sent.append(frame.tracker)
            if self._sent_frames is not None:  # paced: the next frame waits for this one to go
                self._sent_frames.watch(frame.tracker)
            del frame
            self._last_sent_at = time.monotonic()
            self._next += 1
        if self._next < len(self._chunks):
            return False
        self.sending = zmq.MessageTracker(*self._sent)
        self._finish(self.sending)
        return True

    def abandon(self) -> None:
        """Give up the send; its sealed buffer, which ZMQ may still read, is
        not kept, nor the packing's while a packing may still write to it."""
        self._sealed = None
        if isinstance(self._packed, Future) and not self._packed.done():
            self._buffer = None
        self._finish(None)

    def _finish(self, sending: zmq.MessageTracker | None) -> None:
        self._sent = self._chunks = self._packed = None
        if self._buffer is not None:  # only the sealing read it
            self._buffers.give_back(self._buffer)
            self._buffer = None
        if self._sealed is not None:
            self._buffers.give_back(self._sealed, sending)
            self._sealed = None


class SentFrames:
    """Wakes the server once each paced frame has been sent
    (its tracker done: pyzmq sets a threading.Event that no poll can
    watch), so that it sleeps meanwhile instead of looking again and
    again. One thread, asleep on the trackers in turn; counted in the
    copy budget."""

    def __init__(self, wakeup: _Wakeup, budget: CopyBudget):
        self._wakeup, self._budget = wakeup, budget
        self._trackers: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raylm-kv-sent", daemon=True)
        self._thread.start()

    def watch(self, tracker: zmq.MessageTracker, then: Callable[[], None] | None = None) -> None:
        """Once `tracker` is done: `then()`, or wake the server."""
        self._trackers.put((tracker, then or self._wakeup.wake))

    def _run(self) -> None:
        name_this_thread("raylm-kv-sent")
        no_wakeup_preemption()
        self._budget.count_this_thread()
        while True:
            item = self._trackers.get()
            if item is None:
                break
            tracker, then = item
            while not self._closed.is_set():
                try:
                    tracker.wait(_CANCEL_CHECK_S)  # and looks whether the server closed
                    break
                except zmq.NotDone:
                    continue
            then()
        self._budget.forget([threading.get_native_id()])

    def close(self) -> None:
        self._closed.set()
        self._trackers.put(None)
        self._thread.join(timeout=5)
