"""Admission control: the byte budget of buffered batches and the slots of long-lived streams.

Both refuse with ``ResourceExhausted`` carrying a retry hint: the refusal is
about the server's load now, not about the request, so a client may try again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from clipd.server.errors import ResourceExhausted

ALIGNMENT = 64  # bytes: JAX on the CPU reads host buffers aligned to this in place (others it copies)


def aligned_empty(shape, dtype=np.uint8, alignment: int = ALIGNMENT) -> np.ndarray:
    """An uninitialised array whose data starts on an ``alignment``-byte boundary."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class Reservation:
    """Bytes held in a :class:`ByteBudget`; :meth:`give_back` gives them back (once, however often called),
    with the buffers taken for them (:meth:`buffer`), which go back to the budget's pool."""

    __slots__ = ("_budget", "buffers", "nbytes")

    def __init__(self, budget: ByteBudget, nbytes: int) -> None:
        self._budget: ByteBudget | None = budget  # None once given back
        self.nbytes = nbytes
        self.buffers: list[np.ndarray] = []

    def buffer(self, nbytes: int) -> np.ndarray:
        """A 64-byte-aligned uint8 buffer of ``nbytes`` for this reservation's batch: a pooled one of that size
        if there is one (no page faults), else a new one. It goes back to the pool with :meth:`give_back`:
        nothing may use it after that."""
        budget = self._budget
        if budget is None:
            raise RuntimeError("a reservation given back takes no buffer")
        array = budget._pooled(nbytes)
        self.buffers.append(array)
        return array

    def give_back(self, reuse: bool = True) -> None:
        """Gives the bytes back; the buffers go to the pool (``reuse``: a batch that was summed or dropped
        whole) or are freed (a batch abandoned half received: a flood of those leaves nothing pooled)."""
        budget, self._budget = self._budget, None
        if budget is not None:
            buffers, self.buffers = self.buffers, []
            budget._give_back(self.nbytes, buffers if reuse else ())


class ByteBudget:
    """One limit on the bytes of every partly received or queued batch, across all streams.

    A batch reserves its whole size when its first chunk says how big it is, and
    holds it until the device worker has copied it into a staging buffer (or it
    is dropped). A reservation that does not fit waits up to ``wait`` seconds for
    room, then fails: so no number of stalled streams can hold more than ``limit``.

    >>> budget = ByteBudget(100)
    >>> first = budget.reserve(60, wait=0)
    >>> budget.reserve(60, wait=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    clipd.server.errors.ResourceExhausted: a batch of 60 bytes does not fit: 60 of 100 bytes are buffered ...
    >>> first.give_back(); budget.used
    0
    """

    def __init__(self, limit: int | Callable[[], int], pool_idle: float = 30.0) -> None:
        self._limit = limit  # bytes, or a function giving them now (what the memory budget leaves)
        self.used = 0
        self.refused = 0
        self.given_back = 0  # bytes given back in all (the server trims the heap after large amounts)
        self._cond = threading.Condition()
        # Receive buffers of batches given back, by size, for the next batch of that size: a large update's
        # buffer is gigabytes, and faulting in fresh pages ran at about 1 GB/s here (the wire runs at 1-2).
        # Pooled bytes count against the limit with the reserved ones; the pool gives way to reservations
        # and drops what was not reused for ``pool_idle`` seconds.
        self.pool_idle = pool_idle
        self.pooled = 0
        self._pool: dict[int, list[tuple[float, np.ndarray]]] = {}

    @property
    def limit(self) -> int:
        """Bytes that may be buffered now."""
        return self._limit() if callable(self._limit) else self._limit

    def reserve(self, nbytes: int, wait: float) -> Reservation:
        if nbytes > self.limit:
            raise ResourceExhausted(f"a batch of {nbytes} bytes exceeds the buffer of {self.limit} bytes;"
                                    " send smaller batches")
        deadline = time.monotonic() + wait
        with self._cond:
            self._shrink_pool_locked(self.limit - self.used - nbytes, keep=nbytes)
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

    def _give_back(self, nbytes: int, buffers=()) -> None:
        with self._cond:
            self.used -= nbytes
            self.given_back += nbytes
            now = time.monotonic()
            for array in buffers:
                self._pool.setdefault(array.nbytes, []).append((now, array))
                self.pooled += array.nbytes
            self._shrink_pool_locked(self.limit - self.used)
            self._cond.notify_all()

    def prepare(self, sizes: Sequence[int], count: int) -> int:
        """Puts ``count`` sets of receive buffers of ``sizes`` bytes in the pool, their pages faulted in now, as
        far as they fit beside what is reserved and pooled; returns how many sets. An aggregation of a large
        model opens: its first updates then arrive as fast as the later ones, which reuse their buffers (a
        fresh page costs the kernel a zeroing pass: here about as long as receiving it). They stay pooled
        like any other (``pool_idle``, :meth:`drop_pool`).

        >>> budget = ByteBudget(10_000)
        >>> budget.prepare([4096, 1024], 3), budget.pooled, budget.used  # room for one set beside it
        (1, 5120, 0)
        >>> budget.reserve(5120, wait=0).buffer(4096).nbytes, budget.pooled  # taken from the pool
        (4096, 1024)
        """
        made = 0
        for _ in range(count):
            with self._cond:
                if self.used + self.pooled + sum(sizes) > self.limit:
                    break
                self.used += sum(sizes)  # held while being faulted in, then pooled
            arrays = [aligned_empty(n) for n in sizes]
            for array in arrays:
                array[:: mmap.PAGESIZE] = 0  # one write a page faults it in
            self._give_back(sum(sizes), arrays)  # into the pool, as a reservation's buffers go
            made += 1
        return made

    def _pooled(self, nbytes: int) -> np.ndarray:
        with self._cond:
            free = self._pool.get(nbytes)
            if free:
                _, array = free.pop()
                self.pooled -= nbytes
                return array
        return aligned_empty(nbytes)

    def _shrink_pool_locked(self, room: int, keep: int = -1) -> None:
        """Drops pooled buffers idle for ``pool_idle``, then (buffers of size ``keep`` last) until they fit ``room``."""
        now = time.monotonic()
        for size in sorted(self._pool, key=lambda size: size == keep):
            entries = self._pool[size]
            while entries and (self.pooled > max(0, room) or now - entries[0][0] > self.pool_idle):
                entries.pop(0)
                self.pooled -= size
            if not entries:
                del self._pool[size]

    def drop_pool(self) -> None:
        """Frees every pooled buffer (an aggregation finished: the next may have other sizes, or none come)."""
        with self._cond:
            self._pool.clear()
            self.pooled = 0

    def drop_idle_buffers(self) -> None:
        """Frees pooled buffers not reused for ``pool_idle`` seconds (the server calls it once a second)."""
        with self._cond:
            self._shrink_pool_locked(self.limit - self.used)


class StreamSlots:
    """At most ``limit`` streams at once, shared fairly between their owners.

    An owner is whoever a stream speaks for: a credential on a peer host. With
    every slot taken, a newcomer whose owner holds at least two slots fewer than
    the largest holder takes one of that holder's: the stream of that holder that
    has been idle the longest is evicted (its client gets UNAVAILABLE and resumes
    after its last acknowledgement: nothing is lost). Else the newcomer is refused
    at once, with a retry hint. So a flood of stalled streams from one credential
    or one host never keeps out a client with another (max-min fairness), and
    streams of one owner never push each other out.

    >>> class Stream:
    ...     def __init__(self, idle): self.idle, self.evicted = idle, False
    ...     def idle_since(self): return -self.idle
    ...     def evict(self): self.evicted = True
    >>> slots, flood = StreamSlots(2, "stream"), [Stream(5), Stream(9)]
    >>> for s in flood: slots.acquire("mallory", s)
    >>> slots.acquire("mallory", Stream(0))
    Traceback (most recent call last):
    ...
    clipd.server.errors.ResourceExhausted: all 2 stream slots are taken; retry later
    >>> honest = Stream(0); slots.acquire("alice", honest)
    >>> [s.evicted for s in flood]           # the longest idle of the largest holder goes
    [False, True]
    """

    def __init__(self, limit: int, what: str, wait: float = 0.0, waiters: int = 0) -> None:
        self.limit = limit
        self.what = what
        self.wait = wait  # how long a newcomer may wait for a slot to free (a round of short streams)...
        self.waiters = waiters  # ...and how many may wait at once (each holds a server thread meanwhile)
        self.active = 0
        self.refused = 0
        self.evicted = 0
        self._waiting = 0
        self._held: dict = {}  # owner -> the evictable streams it holds (those given with acquire)
        self._counts: dict = {}  # owner -> slots it holds
        self._lock = threading.Condition()

    def acquire(self, owner=None, stream=None) -> None:
        """Takes a slot for ``owner``; ``stream`` (with ``idle_since()`` and ``evict()``) may be evicted later."""
        with self._lock:
            if self.active >= self.limit and not self._evict_for(owner):
                if self._waiting < self.waiters and self.wait > 0:
                    self._waiting += 1
                    try:
                        self._lock.wait_for(lambda: self.active < self.limit, self.wait)
                    finally:
                        self._waiting -= 1
                if self.active >= self.limit:
                    self.refused += 1
                    raise ResourceExhausted(f"all {self.limit} {self.what} slots are taken; retry later",
                                            retry_after=1.0)
            self.active += 1
            self._counts[owner] = self._counts.get(owner, 0) + 1
            if stream is not None:
                self._held.setdefault(owner, []).append(stream)

    def _evict_for(self, owner) -> bool:
        """Evicts the longest-idle stream of the largest holder if ``owner`` holds 2+ fewer; True if one went."""
        mine = self._counts.get(owner, 0)
        for holder in sorted(self._counts, key=self._counts.__getitem__, reverse=True):
            if holder == owner or self._counts[holder] < mine + 2:
                return False
            candidates = [s for s in self._held.get(holder, ()) if not getattr(s, "evicted", False)]
            if candidates:
                victim = min(candidates, key=lambda s: s.idle_since())
                victim.evict()  # it gives its slot back when its call ends (within a second)
                self.evicted += 1
                return True
        return False

    def release(self, owner=None, stream=None) -> None:
        with self._lock:
            self.active -= 1
            self._lock.notify()
            self._counts[owner] -= 1
            if not self._counts[owner]:
                del self._counts[owner]
            if stream is not None:
                held = self._held.get(owner, [])
                if stream in held:
                    held.remove(stream)
                if not held:
                    self._held.pop(owner, None)

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
    flood. The server calls this after large amounts were given back.
    """
    if _TRIM is not None:
        _TRIM(0)
