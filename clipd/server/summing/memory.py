"""Memory for updates in flight: the byte budget of buffered batches, its pool of aligned receive buffers, and
giving freed pages back to the OS.

A batch reserves its bytes in the one :class:`ByteBudget` of its process when its first chunk arrives (waiting a
while for room, else RESOURCE_EXHAUSTED with a retry hint: the refusal is about the server's load now, not about
the request) and gives them back once the device worker has copied it, or it is dropped. Buffers the device step
reads in place are 64-byte aligned (:func:`aligned_empty`): JAX on the CPU reads those without a copy. Used by
the RPC layer (which receives batches into them) and by the summing runtime (which reads and frees them).
"""

from __future__ import annotations

import collections
import ctypes
import gc
import math
import mmap
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from clipd._process import libc_function
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
        self.fresh = 0  # receive buffers allocated outside the pool (none prepared, or all taken)
        self._cond = threading.Condition()
        # Receive buffers of batches given back, by size, for the next batch of that size: a large update's
        # buffer is gigabytes, and faulting in fresh pages ran at about 1 GB/s here (the wire runs at 1-2).
        # Pooled bytes count against the limit with the reserved ones; the pool gives way to reservations
        # and drops what was not reused for ``pool_idle`` seconds.
        self.pool_idle = pool_idle
        self.pooled = 0
        self._pool: dict[int, list[tuple[float, np.ndarray]]] = {}
        self._returned: collections.deque[np.ndarray] = collections.deque()  # lent buffers back (lend_until_freed)

    @property
    def limit(self) -> int:
        """Bytes that may be buffered now."""
        return self._limit() if callable(self._limit) else self._limit

    def reserve(self, nbytes: int, wait: float) -> Reservation:
        limit = self.limit  # (a derived limit is computed once a try: it sums the open aggregations)
        if nbytes > limit:
            raise ResourceExhausted(f"a batch of {nbytes} bytes exceeds the buffer of {limit} bytes;"
                                    " send smaller batches")
        deadline = time.monotonic() + wait
        with self._cond:
            if self._pool or self._returned:
                self._shrink_pool_locked(limit - self.used - nbytes, keep=nbytes)
            while self.used + nbytes > limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refused += 1
                    raise ResourceExhausted(
                        f"a batch of {nbytes} bytes does not fit: {self.used} of {limit} bytes are"
                        " buffered for other batches; retry later", retry_after=1.0)
                self._cond.wait(left)
                limit = self.limit
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
            if self._pool:
                self._shrink_pool_locked(self.limit - self.used)
            self._cond.notify_all()

    def prepare(self, sizes: Sequence[int], count: int) -> int:
        """Puts ``count`` sets of receive buffers of ``sizes`` bytes in the pool, their pages faulted in now, as
        far as they fit beside what is reserved and pooled; returns how many sets. An aggregation of a large
        model opens: its first updates then arrive as fast as the later ones, which reuse their buffers (a
        fresh page costs the kernel a zeroing pass: here about as long as receiving it). They stay pooled
        like any other (``pool_idle``, :meth:`drop_pool`).

        Sets already pooled (the last round's, of the same layers) count, and are kept fresh: the next round of
        a job reuses its buffers instead of faulting in new pages.

        >>> budget = ByteBudget(10_000)
        >>> budget.prepare([4096, 1024], 3), budget.pooled, budget.used  # room for one set beside it
        (1, 5120, 0)
        >>> budget.prepare([4096, 1024], 1), budget.fresh  # the pooled set is the one asked for: nothing new
        (1, 0)
        >>> budget.reserve(5120, wait=0).buffer(4096).nbytes, budget.pooled  # taken from the pool
        (4096, 1024)
        """
        with self._cond:
            self._file_returned_locked()
            now = time.monotonic()
            wanted = collections.Counter(sizes)
            pooled = min(len(self._pool.get(n, ())) // k for n, k in wanted.items()) if wanted else 0
            for n in wanted:  # reused soon: not idle
                self._pool[n] = [(now, array) for _, array in self._pool.get(n, [])]
        made = min(pooled, count)
        for _ in range(count - made):
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
            self._file_returned_locked()
            free = self._pool.get(nbytes)
            if free:
                _, array = free.pop()
                self.pooled -= nbytes
                return array
            self.fresh += 1
        return aligned_empty(nbytes)

    def _shrink_pool_locked(self, room: int, keep: int = -1) -> None:
        """Drops pooled buffers idle for ``pool_idle``, then (buffers of size ``keep`` last) until they fit ``room``."""
        self._file_returned_locked()
        now = time.monotonic()
        for size in sorted(self._pool, key=lambda size: size == keep):
            entries = self._pool[size]
            while entries and (self.pooled > max(0, room) or now - entries[0][0] > self.pool_idle):
                entries.pop(0)
                self.pooled -= size
            if not entries:
                del self._pool[size]

    def take_set(self, sizes: Sequence[int]) -> list[np.ndarray] | None:
        """One pooled buffer of each of ``sizes`` bytes, taken out of the pool; None, taking nothing, unless the
        pool holds them all. A finalized large model's result is written into the receive buffers its round no
        longer needs, instead of beside them; see :meth:`lend_until_freed` for their way back.

        >>> budget = ByteBudget(10_000)
        >>> budget.prepare([1024, 1024], 1), budget.pooled
        (1, 2048)
        >>> [b.nbytes for b in budget.take_set([1024, 1024])], budget.pooled, budget.take_set([1024])
        ([1024, 1024], 0, None)
        """
        needed: dict[int, int] = {}
        for size in sizes:
            needed[size] = needed.get(size, 0) + 1
        with self._cond:
            self._file_returned_locked()
            if any(len(self._pool.get(size, ())) < count for size, count in needed.items()):
                return None
            taken = []
            for size in sizes:
                _, array = self._pool[size].pop()
                if not self._pool[size]:
                    del self._pool[size]
                self.pooled -= size
                taken.append(array)
            return taken

    def lend_until_freed(self, user: np.ndarray, buffer: np.ndarray) -> None:
        """``buffer`` (taken with :meth:`take_set`) goes back to the pool when ``user`` (the array made over it,
        which is all that may use it) is freed: a result's buffers serve the next round once the result is gone.

        >>> budget = ByteBudget(10_000)
        >>> [buffer] = budget.prepare([4096], 1) and budget.take_set([4096])
        >>> result = buffer.view(np.float32); budget.lend_until_freed(result, buffer); budget.pooled
        0
        >>> del result, buffer; budget.pooled
        4096
        """
        weakref.finalize(user, self._lent_back, buffer)

    def _lent_back(self, buffer: np.ndarray) -> None:
        """A lent buffer's user was freed: into the pool (a finalizer runs in whatever thread dropped the last
        reference, holding whatever it holds: it never waits for this budget's lock, the next holder files it)."""
        self._returned.append(buffer)
        if self._cond.acquire(blocking=False):
            try:
                self._file_returned_locked()
            finally:
                self._cond.release()

    def _file_returned_locked(self) -> None:
        now = time.monotonic()
        while self._returned:
            buffer = self._returned.popleft()
            self._pool.setdefault(buffer.nbytes, []).append((now, buffer))
            self.pooled += buffer.nbytes

    def fit_pool(self) -> None:
        """Frees pooled buffers until they fit what the budget allows now (an aggregation finished: its result
        may take room); what stays waits ``pool_idle`` for the next round of the same layers."""
        with self._cond:
            self._shrink_pool_locked(self.limit - self.used)

    def drop_pool(self) -> None:
        """Frees every pooled buffer."""
        with self._cond:
            self._returned.clear()
            self._pool.clear()
            self.pooled = 0

    def drop_idle_buffers(self) -> None:
        """Frees pooled buffers not reused for ``pool_idle`` seconds (the server calls it once a second)."""
        with self._cond:
            self._shrink_pool_locked(self.limit - self.used)


_TRIM = libc_function("malloc_trim", [ctypes.c_size_t])  # None: not glibc


def trim_heap() -> None:
    """Gives the C heap's free pages back to the system (glibc ``malloc_trim``; elsewhere nothing).

    Batch buffers are large and short-lived: once freed, glibc keeps their pages
    in the heap, so the process would stay at its peak resident size after a
    flood. The server calls this after large amounts were given back.
    """
    if _TRIM is not None:
        _TRIM(0)


class HeapTrimmer:
    """A thread that, once every ``period`` seconds, frees the pooled receive buffers ``budget`` has not reused for
    its ``pool_idle``, and trims the heap (:func:`trim_heap`) if ``threshold`` bytes or more of batch buffers were
    given back since it last did and no batch holds a reservation now. Every process that receives batches runs
    one (``clipd serve`` and each of its shard processes: each has a heap of its own), so that a flood of
    abandoned batches leaves none of them at its peak resident size; while batches keep coming (a round of
    thousands of clients) the freed pages are theirs to reuse, not the kernel's to fault in again."""

    def __init__(self, budget: ByteBudget, period: float = 1.0, threshold: int = 64 << 20) -> None:
        self.budget, self.period, self.threshold = budget, period, threshold
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="clipd-trim", daemon=True)

    def start(self) -> HeapTrimmer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        trimmed = 0
        while not self._stopped.wait(self.period):
            self.budget.drop_idle_buffers()
            given_back = self.budget.given_back
            if given_back - trimmed >= self.threshold and self.budget.used == 0:
                gc.collect(0)  # (a batch's last references may be in young garbage cycles)
                trim_heap()
                trimmed = given_back
