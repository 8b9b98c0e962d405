"""Doorbells: how a shared-memory queue's writer wakes its sleeping readers.

A reader that finds no message spins briefly, then must wait without burning a
core that the model's ranks need. Sleeping in growing intervals (what readers
did before) makes a message wait for the end of the reader's current sleep,
up to a millisecond on a step's critical path; spinning longer steals the
core from a rank on a small machine. A doorbell is a named pipe (FIFO) per
reader: the writer writes a byte after it publishes a message, and a waiting
reader sleeps in the kernel (select) until that byte arrives, so it wakes
within microseconds and costs nothing while idle.

No wake-up is lost: the byte stays in the pipe until the reader drains it,
and the reader drains before it re-checks the ring, so a message published
between its check and its wait is found at once. Extra bytes only cause an
early re-check. Each pipe (mode 0600) is named by the writer's prefix and the
reader's slot; each reader unlinks its own pipe once it has opened it (the
writer holds it open), so once every reader has attached nothing is left on
disk even if a process is killed; the writer unlinks those never attached.
"""

from __future__ import annotations

import os
import secrets
import select
import tempfile
import time

_DRAIN_BYTES = 4096


class DoorbellWriter:
    """The writer's side: one pipe per local reader slot, rung all at once."""

    def __init__(self, num_readers: int):
        self.prefix = os.path.join(tempfile.gettempdir(), f"raylm-bell-{os.getpid()}-{secrets.token_hex(6)}")
        self._num_readers = num_readers
        self._fds: list[int] = []
        try:
            for slot in range(num_readers):
                path = self.path(self.prefix, slot)
                os.mkfifo(path, 0o600)
                # O_RDWR: opening never blocks for want of a reader (Linux), and
                # writes succeed before the reader has attached.
                self._fds.append(os.open(path, os.O_RDWR | os.O_NONBLOCK))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def path(prefix: str, slot: int) -> str:
        return f"{prefix}-{slot}"

    def ring(self) -> None:
        for fd in self._fds:
            try:
                os.write(fd, b"\x01")
            except BlockingIOError:
                pass  # the pipe is full: that reader has wake-ups pending already

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for slot in range(self._num_readers):
            try:
                os.unlink(self.path(self.prefix, slot))
            except FileNotFoundError:
                pass  # its reader attached and unlinked it


class DoorbellReader:
    """A reader's side: waits for its bell with a timeout."""

    def __init__(self, prefix: str, slot: int):
        path = DoorbellWriter.path(prefix, slot)
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.unlink(path)  # the writer holds it open: nothing on disk needs to outlive the attach
        self._writer_gone = False

    def wait(self, timeout_s: float) -> None:
        """Return when rung (or after `timeout_s`), with the bell drained."""
        if self._writer_gone:
            # A dead writer's pipe reads as always ready (end of file): sleep
            # instead, and let the caller's deadline or closed flag end the wait.
            time.sleep(min(max(0.0, timeout_s), 1e-3))
            return
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout_s))
        if ready:
            try:
                while True:
                    if not os.read(self._fd, _DRAIN_BYTES):
                        self._writer_gone = True  # end of file: no process holds the writing end
                        return
            except BlockingIOError:
                pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
