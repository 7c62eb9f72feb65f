"""Admission control: the byte budget of buffered batches and the slots of long-lived streams.

Both refuse with ``ResourceExhausted`` carrying a retry hint: the refusal is
about the server's load now, not about the request, so a client may try again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

from .errors import ResourceExhausted


class Reservation:
    """Bytes held in a :class:`ByteBudget`; :meth:`release` gives them back (once, however often called)."""

    __slots__ = ("_budget", "nbytes")

    def __init__(self, budget: ByteBudget, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back(self.nbytes)


class ByteBudget:
    """One limit on the bytes of every partly received or queued batch, across all streams.

    A batch reserves its whole size when its first chunk says how big it is, and
    holds it until the device worker has copied it into a staging buffer (or it
    is dropped). A reservation that does not fit waits up to ``wait`` seconds for
    room, then fails: so no number of stalled streams can hold more than ``limit``.

    >>> budget = ByteBudget(100)
    >>> first = budget.reserve(60, wait=0)
    >>> budget.reserve(60, wait=0)
    Traceback (most recent call last):
    ...
    clipd.server.errors.ResourceExhausted: a batch of 60 bytes does not fit: 60 of 100 bytes are buffered for other batches; retry later
    >>> first.release(); budget.used
    0
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.refused = 0
        self.released = 0  # bytes given back in all (the server trims the heap after large releases)
        self._cond = threading.Condition()

    def reserve(self, nbytes: int, wait: float) -> Reservation:
        if nbytes > self.limit:
            raise ResourceExhausted(f"a batch of {nbytes} bytes exceeds the buffer of {self.limit} bytes;"
                                    " send smaller batches")
        deadline = time.monotonic() + wait
        with self._cond:
            while self.used + nbytes > self.limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refused += 1
                    raise ResourceExhausted(
                        f"a batch of {nbytes} bytes does not fit: {self.used} of {self.limit} bytes are"
                        " buffered for other batches; retry later", retry_after=1.0)
                self._cond.wait(left)
            self.used += nbytes
        return Reservation(self, nbytes)

    def _give_back(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self.released += nbytes
            self._cond.notify_all()


class StreamSlots:
    """At most ``limit`` streams at once; one more is refused at once, with a retry hint."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what
        self.active = 0
        self.refused = 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            if self.active >= self.limit:
                self.refused += 1
                raise ResourceExhausted(f"all {self.limit} {self.what} slots are taken; retry later",
                                        retry_after=1.0)
            self.active += 1

    def release(self) -> None:
        with self._lock:
            self.active -= 1

    @property
    def saturated(self) -> bool:
        return self.active >= self.limit


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Gives the C heap's free pages back to the system (glibc ``malloc_trim``; elsewhere nothing).

    Batch buffers are large and short-lived: once freed, glibc keeps their pages
    in the heap, so the process would stay at its peak resident size after a
    flood. The server calls this after large amounts were released.
    """
    if _TRIM is not None:
        _TRIM(0)
