"""The exactly-once bookkeeping of one aggregation: each client's batch sequence numbers and open streams.

Three marks per client, each the highest batch sequence number in a stage::

    accepted  >=  summed  >=  durable
    (taken in)   (in the sum)  (in a committed checkpoint: what streams acknowledge)

A client's batches are numbered 1, 2, 3, ... A batch at or below ``accepted`` is a duplicate (a client
resending what it was not yet told is durable); one that skips a number is refused. Streams of one
*writer* (one submission) may be open for a client at once; another writer's is refused while they
are, so two submissions never number one client's batches twice.

Not thread-safe on its own: :class:`clipd.server.aggregations.Aggregation` holds its condition around
every call.

>>> seq = ClientSequences(max_clients=None)
>>> seq.attach("alice", "w1")
(0, 0, '')
>>> seq.accept("alice", 1, "w1"), seq.accept("alice", 1, "w1")
(True, False)
>>> seq.mark_summed("alice", 1); seq.mark_durable({"alice": (1, "w1")}); seq.durable("alice")
1
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Mapping

from clipd.server.errors import FailedPrecondition, ResourceExhausted
from clipd.wire import SPREAD_MARK


def client_of(client_id: str) -> str:
    """The client a stream's id speaks for: ``alice`` for ``alice``, ``alice~1``, ``alice~2``, ..."""
    return client_id.rpartition(SPREAD_MARK)[0] or client_id


class ClientSequences:
    """Each client's accepted, summed and durable marks, last writer and open streams (see the module)."""

    def __init__(self, marks: Mapping[str, tuple[int, str]] | None = None, max_clients: int | None = None) -> None:
        """``marks``: ``{client: (sequence, writer)}`` of a recovered checkpoint (all three marks start there)."""
        marks = marks or {}
        self.max_clients = max_clients
        self._accepted = {client: sequence for client, (sequence, _) in marks.items()}
        self._summed = dict(self._accepted)
        self._durable = dict(self._accepted)
        self._last_writer = {client: writer for client, (_, writer) in marks.items()}
        self._open_writers: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        # Client ids (accepted, or with a stream open) per client: the streams of a spread submission are one
        # client for max_clients. Kept as it changes, so a new client costs O(1), not O(clients).
        self._ids_per_client = collections.Counter(client_of(c) for c in self._accepted)

    def _known(self, client_id: str) -> bool:
        return client_id in self._accepted or client_id in self._open_writers

    def _check_room_for(self, client_id: str, what: str) -> None:
        if self.max_clients is None or self._known(client_id) or client_of(client_id) in self._ids_per_client:
            return
        known = len(self._ids_per_client)
        if known >= self.max_clients:
            raise ResourceExhausted(f"{what} has {known} clients, the limit is {self.max_clients} (max_clients)")

    def attach(self, client_id: str, writer: str, what: str = "the aggregation") -> tuple[int, int, str]:
        """A stream of ``writer`` opens for ``client_id``: ``(durable, accepted, last writer)``.

        Refused while a stream of another writer is open for the client (their sequence numbers would
        collide), and when a new client would pass ``max_clients``. ``writer`` "" (a stream without a
        hello) is never refused for another writer.
        """
        self._check_room_for(client_id, what)
        others = [w for w, n in self._open_writers.get(client_id, {}).items() if n and w != writer]
        if writer and others:
            raise FailedPrecondition(f"client {client_id!r} is being written by another submission; wait for it"
                                     " to end or use another client_id")
        if not self._known(client_id):
            self._ids_per_client[client_of(client_id)] += 1
        self._open_writers[client_id][writer] += 1
        return self.durable(client_id), self._accepted.get(client_id, 0), self._last_writer.get(client_id, "")

    def detach(self, client_id: str, writer: str) -> bool:
        """A stream of ``writer`` for ``client_id`` ended; True if it was the last stream open at all."""
        writers = self._open_writers[client_id]
        writers[writer] -= 1
        if writers[writer] <= 0:
            del writers[writer]
        if not writers:
            del self._open_writers[client_id]
            if client_id not in self._accepted:
                client = client_of(client_id)
                self._ids_per_client[client] -= 1
                if self._ids_per_client[client] <= 0:
                    del self._ids_per_client[client]
        return not self._open_writers

    def streams_of(self, client_id: str, writer: str) -> int:
        """How many streams of ``writer`` are open for ``client_id``."""
        writers = self._open_writers.get(client_id)
        return writers[writer] if writers else 0

    @property
    def receiving(self) -> bool:
        """Whether any stream is open."""
        return bool(self._open_writers)

    def accept(self, client_id: str, sequence: int, writer: str = "", what: str = "the aggregation") -> bool:
        """Takes batch ``sequence`` of ``client_id`` in: True if new, False if a duplicate of an accepted one.
        ``FailedPrecondition`` if it skips a number."""
        if client_id not in self._accepted:
            self._check_room_for(client_id, what)
        last = self._accepted.get(client_id, 0)
        if sequence <= last:
            return False
        if sequence != last + 1:
            raise FailedPrecondition(
                f"client {client_id!r}: batch {sequence} after {last}; sequence numbers go up by one from 1")
        if not self._known(client_id):
            self._ids_per_client[client_of(client_id)] += 1
        self._accepted[client_id] = sequence
        self._last_writer[client_id] = writer
        return True

    def mark_summed(self, client_id: str, sequence: int) -> None:
        """Batch ``sequence`` of the client is in the sum (not yet durable)."""
        if sequence > self._summed.get(client_id, 0):
            self._summed[client_id] = sequence

    def mark_durable(self, marks: Mapping[str, tuple[int, str]]) -> None:
        """A checkpoint holding these ``{client: (sequence, writer)}`` marks was committed."""
        for client, (sequence, _) in marks.items():
            if sequence > self._durable.get(client, 0):
                self._durable[client] = sequence

    def accepted(self, client_id: str) -> int:
        return self._accepted.get(client_id, 0)

    def summed(self, client_id: str) -> int:
        """The client's highest batch in the sum (durable or not yet)."""
        return max(self._summed.get(client_id, 0), self._durable.get(client_id, 0))

    def durable(self, client_id: str) -> int:
        """The client's highest batch in a committed checkpoint."""
        return self._durable.get(client_id, 0)

    def accepted_batches(self) -> int:
        """Batches accepted from all clients together (each client's sequence numbers start at 1)."""
        return sum(self._accepted.values())

    def clients(self) -> int:
        """Clients known (spread streams of one client count once)."""
        return len(self._ids_per_client)

    def submitted(self, marks: Iterable[str] = ()) -> int:
        """Clients with a batch accepted, with those of ``marks`` (a partial state's clients: what a checkpoint
        or a shard holds); spread streams of one client count once."""
        return len({client_of(c) for c in itertools.chain(self._accepted, marks)})
