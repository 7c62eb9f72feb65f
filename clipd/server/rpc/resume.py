"""Batches that broken Submit streams left partly received, kept a while for a resuming stream of their writer.

A large update's stream that breaks inside a batch leaves the bytes received on the process that received them
(see ``SubmitRequest.resume``): the broken stream's reader thread parks them here and holds them for
``stream_idle_timeout`` seconds; a hello with ``resume`` from the same writer takes them up and the stream goes on
from there; any other hello of that client drops them. Whatever way a parked batch goes, its buffers and bytes
in the server's budget are given back.
"""

from __future__ import annotations

import threading
import time

RESUME_WAIT = 5.0  # seconds a resuming stream waits for the server to see its writer's old stream end


class ParkedBatches:
    """Partly received batches by (aggregation, client): ``[writer, partial]`` entries, ``partial`` None once
    taken or dropped. Every method may be called from any stream's thread."""

    def __init__(self, keep_seconds: float) -> None:
        self.keep_seconds = keep_seconds
        self._entries: dict[tuple[str, str], list] = {}
        self._cond = threading.Condition()

    def park(self, key: tuple[str, str], writer: str, partial) -> list:
        """Keeps a broken stream's partly received batch for a resuming stream of ``writer``; :meth:`keep` then
        holds it for ``keep_seconds``."""
        entry = [writer, partial]
        with self._cond:
            self._drop_locked(key)
            self._entries[key] = entry
            self._cond.notify_all()
        return entry

    def keep(self, key: tuple[str, str], entry: list) -> None:
        """Waits until a resuming stream takes the parked batch, or ``keep_seconds``; then its buffers and bytes
        go. Run by the broken stream's reader thread (the stream itself has ended)."""
        with self._cond:
            self._cond.wait_for(lambda: entry[1] is None, self.keep_seconds)
            if self._entries.get(key) is entry:
                del self._entries[key]
            left, entry[1] = entry[1], None
        if left is not None and left.reservation is not None:
            left.reservation.give_back(reuse=False)

    def take(self, key: tuple[str, str], writer: str, resume: bool, still_open=lambda: False):
        """The batch a broken stream of ``writer`` left for this client, if ``resume``; any other is dropped.

        A resuming stream may come before the server has seen its old stream break: while ``still_open()``
        (another stream of the writer is attached) it waits for that one to end, a few seconds at most."""
        deadline = time.monotonic() + min(RESUME_WAIT, self.keep_seconds)
        with self._cond:
            while (resume and writer and key not in self._entries and still_open()
                   and (left := deadline - time.monotonic()) > 0):
                self._cond.wait(min(left, 0.05))
            entry = self._entries.get(key)
            if entry is None:
                return None
            if resume and entry[0] == writer and writer:
                del self._entries[key]
                partial, entry[1] = entry[1], None
                self._cond.notify_all()
                return partial
            self._drop_locked(key)
            return None

    def _drop_locked(self, key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            partial, entry[1] = entry[1], None
            self._cond.notify_all()
            if partial is not None and partial.reservation is not None:
                partial.reservation.give_back(reuse=False)
