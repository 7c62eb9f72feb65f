"""Admission control: the slots of long-lived streams (Submit, health-watch, reflection) and the queue of
one-message submissions (SubmitOne).

A stream that can't have a slot is refused with ``ResourceExhausted`` carrying a retry hint: the refusal is about
the server's load now, not about the request, so a client may try again. A one-message submission waits its turn
instead (:class:`Admission`), and only a full queue refuses, with an appointment. The byte budget of the batches
both carry is :mod:`clipd.server.summing.memory`'s.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

from clipd.server.errors import ResourceExhausted

MIN_RETRY_AFTER = 0.05  # seconds: the least and the most a refused call or stream is told to wait
MAX_RETRY_AFTER = 30.0
RATE_WINDOW = 5.0  # seconds of ends the drain rate is measured over
FIRST_CALL_SECONDS = 0.1  # what a one-message call is taken to last before any has ended (a server just started)
CROWD = 2  # one-message calls in flight at once from which checkpoints are spaced by busy_checkpoint_interval
FIRST_STREAM_SECONDS = 1.0  # what a stream is taken to last before any has ended


class Appointments:
    """Retry hints that spread the refused over the time the server needs: the first one after the ``held``
    calls (or streams) would drain at the rate they ended over the last ``RATE_WINDOW`` seconds, each next one
    an end's time after the one before, between ``MIN_RETRY_AFTER`` and ``MAX_RETRY_AFTER``. So a herd refused
    at once comes back spread out, about as fast as the server takes it in, instead of all together.

    >>> appointments = Appointments(first_rate=10.0)     # 10 ends a second assumed before any was seen
    >>> [round(appointments.book(held=2, now=0.0), 3) for _ in range(3)]
    [0.2, 0.3, 0.4]
    >>> for t in (0.0, 0.5, 1.0): appointments.ended(now=t)          # 2 a second measured
    >>> round(appointments.book(held=2, now=1.0), 3)                  # after the two held: 1 s
    1.0
    """

    def __init__(self, first_rate: float, keep: int = 256) -> None:
        self.first_rate = first_rate
        self._ended: collections.deque[float] = collections.deque(maxlen=keep)
        self._booked = 0.0  # the latest appointment given (time.monotonic())
        self._lock = threading.Lock()

    def ended(self, now: float | None = None) -> None:
        """One held call or stream ended."""
        with self._lock:
            self._ended.append(time.monotonic() if now is None else now)

    def book(self, held: int, now: float | None = None) -> float:
        """The seconds after which a refused newcomer should come back, with ``held`` ahead of it (booked)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            rate = self._rate_locked(now)
            self._booked = max(now + held / rate, self._booked + 1.0 / rate)
            return min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, self._booked - now))

    def _rate_locked(self, now: float) -> float:
        recent = [t for t in self._ended if now - t <= RATE_WINDOW]
        if len(recent) < 2:
            return max(1.0, self.first_rate)
        return max(1.0, (len(recent) - 1) / max(recent[-1] - recent[0], 1e-3))


class StreamSlots:
    """At most ``limit`` streams at once, shared fairly between their owners.

    An owner is whoever a stream speaks for: a credential on a peer host. With
    every slot taken, a newcomer whose owner holds at least two slots fewer than
    the largest holder takes one of that holder's: the stream of that holder that
    has been idle the longest is evicted (its client gets UNAVAILABLE and resumes
    after its last acknowledgement: nothing is lost). Else the newcomer is refused
    at once, with an appointment (:class:`Appointments`). So a flood of stalled streams from one credential
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
        self.appointments = Appointments(limit / FIRST_STREAM_SECONDS)  # the refused's retry hints

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
                                            retry_after=self.appointments.book(self.active))
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
        self.appointments.ended()
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


class Admission:
    """One-message submissions (SubmitOne): ``workers`` run at once on a thread pool of their own, up to ``queue``
    more wait for a worker, and beyond that a newcomer is refused with an appointment.

    A waiting call costs no buffer: gRPC reads a call's message when a worker takes it up (until then the
    runtime holds at most its flow-control window of it). So a round of thousands of clients that arrive together
    queues instead of being refused, and the other RPCs keep threads of their own. A newcomer that finds
    ``workers + queue`` calls held is refused (``RESOURCE_EXHAUSTED``) with an appointment (:class:`Appointments`,
    at the rate calls have ended).

    >>> admission = Admission(workers=1, queue=1)
    >>> admission.held = 2                                # one running, one waiting: the queue is full
    >>> admission.crowded()
    True
    >>> first, second = admission.retry_after(now=0.0), admission.retry_after(now=0.0)
    >>> round(first, 3), round(second, 3)                 # 10 calls/s assumed before any finished
    (0.2, 0.3)
    >>> admission.held = 1; admission.retry_after(now=0.0) is None
    True
    """

    def __init__(self, workers: int, queue: int) -> None:
        self.workers, self.queue = workers, queue
        self.pool = _CountingPool(self, workers)
        self.held = 0  # calls handed to the pool and not finished (running or waiting)
        self.refused = 0
        self.appointments = Appointments(workers / FIRST_CALL_SECONDS, keep=max(64, 4 * workers))
        self._lock = threading.Lock()

    def retry_after(self, now: float | None = None) -> float | None:
        """None if a newcomer may wait for a worker; else the seconds after which it should come back (booked)."""
        if self.held < self.workers + self.queue:  # (read without the lock: one more or less is harmless)
            return None
        with self._lock:
            self.refused += 1
        return self.appointments.book(self.held, now)

    def crowded(self) -> bool:
        """Whether a crowd of calls is in flight: two or more at once (a round's clients, not one trainer's
        sequential steps), whose acknowledgements may share checkpoints spaced further apart."""
        return self.held >= CROWD

    def _started(self) -> None:
        with self._lock:
            self.held += 1

    def _ended(self) -> None:
        with self._lock:
            self.held -= 1
        self.appointments.ended()


class ServerPool(concurrent.futures.ThreadPoolExecutor):
    """A gRPC server's thread pool that stops asking whether a thread is idle once all of its threads exist.

    The standard pool asks at every hand-over (``_adjust_thread_count``), with a semaphore acquired with a zero
    timeout; when none is idle (a busy server) that acquire waits on a condition for zero seconds, which lets
    go of the GIL: the server's one polling thread paid a switch to another thread on every call it handed
    over. Once ``max_workers`` threads run there is nothing to decide."""

    def _adjust_thread_count(self) -> None:
        if len(self._threads) < self._max_workers:
            super()._adjust_thread_count()


class _CountingPool(ServerPool):
    """The one-message calls' pool (gRPC runs a handler whose behavior names it, ``experimental_thread_pool``, on
    it): counts each call from its hand-over to its end, however it ends (a client gone while it waited too)."""

    def __init__(self, admission: Admission, workers: int) -> None:
        super().__init__(workers, thread_name_prefix="clipd-one")
        self._admission = admission

    def submit(self, fn, /, *args, **kwargs):
        self._admission._started()
        try:
            return super().submit(self._counted, fn, *args, **kwargs)
        except BaseException:
            self._admission._ended()
            raise

    def _counted(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            self._admission._ended()


def on_pool(behavior, pool: concurrent.futures.ThreadPoolExecutor):
    """``behavior`` (a handler's function) run by gRPC on ``pool`` instead of the server's."""
    def run(request, context):
        return behavior(request, context)

    run.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return run
