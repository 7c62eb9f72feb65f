"""Admission control of long-lived streams: the slots of Submit streams (and health-watch and reflection streams).

A stream that can't have a slot is refused with ``ResourceExhausted`` carrying a retry hint: the refusal is about
the server's load now, not about the request, so a client may try again. The byte budget of the batches those
streams carry is :mod:`clipd.server.summing.memory`'s.
"""

from __future__ import annotations

import threading

from clipd.server.errors import ResourceExhausted


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
