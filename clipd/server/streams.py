"""Buffered streams (FedBuff): a new model version each time K contributions are in, from clients that never wait.

A stream is made once (its layers, clip policy, a privacy policy with participation limits, its buffer's rules)
and then takes contributions until it stops (its budget, or its caller). Its buffers are aggregations of the
server's own: buffer V (id ``<stream>.v<V>``) is released as model version V, with every aggregation's data
path (credentials, exactly once within it, the clip, durable checkpoints, the private release on the stream's
ledger). This module decides which buffer a contribution goes into, with what weight, and when a buffer goes:

- a contribution says the version it was trained from (v); landing in the buffer of version V it is
  ``tau = V - 1 - v`` stale and weighted by ``(1 + tau)^-a`` after its clip (``engine._buffered``), so the
  bound stays the sensitivity; staler than ``max_staleness``, or from a version not out yet, it is refused;
- each client numbers its contributions to the stream 1, 2, 3, ...: the n-th is counted once. One the stream
  has (released: the ledger records each release's participants; or in a buffer not released yet) is a
  duplicate, acknowledged with the version it counts in;
- the participation limits (at most k contributions, at least b versions apart) are the ledger's (or its
  correlated noise stream's: version V is the stream's release V - 1, noised by its row), checked with the
  client's contributions in buffers not released yet counted too;
- when the ledger refuses a buffer (its budget, its noise stream's planned releases) the buffers before it
  still fill and release, and the stream stops after the last of them;
- the buffer being filled takes its K-th contribution and the next one, open already, takes the ones after: a
  contribution is never refused because a buffer is closing. A full buffer is released once everything it took
  is summed (``Lifecycle.finalize``), in version order, by the stream's release thread; with ``max_wait`` a
  buffer that has waited that long with at least ``min_size`` contributions is released as it is;
- after a restart a stream goes on from its buffers as the store has them: a buffer whose checkpoint holds K
  contributions is released (once: its release commits with its ledger entry), and so is a shorter one that a
  later buffer holding contributions follows (what was taken but not durable is gone, and the clients in the
  later one may not be able to fill it); the others fill on.

Each buffer's contribution carries the version it was trained from as its writer id (``v<version>``), kept in
the buffer's checkpoints, so a release states its contributions' staleness whatever happened in between.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator

from clipd.engine import ClipPolicy, Unit
from clipd.engine import _buffered as buffered
from clipd.engine import _privacy as dp
from clipd.server.aggregations import Aggregation, AggregationSpec, State
from clipd.server.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from clipd.server.lifecycle import Lifecycle
from clipd.server.logs import event
from clipd.server.privacy import participation_limits
from clipd.server.sequences import client_of
from clipd.server.stores.base import StreamRecord

log = logging.getLogger(__name__)
OPEN, STOPPED = "open", "stopped"
WAIT_FOR_BUFFER = 30.0  # seconds a contribution waits for the next buffer to open (it opens as the last fills)
PARTICIPANTS_IN_MEMORY = 1 << 20  # clients whose released versions a stream keeps in memory (about 200 bytes each)


@dataclasses.dataclass(frozen=True)
class BufferPolicy:
    """When a stream's buffer is released, and what its contributions weigh (see the module)."""

    size: int
    staleness_exponent: float = buffered.DEFAULT_EXPONENT
    max_staleness: int = 10
    max_wait: float = 0.0  # seconds; 0: only a full buffer is released
    min_size: int = 1
    keep_versions: int = 100

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"buffer.size: at least 1 contribution, got {self.size}")
        if not (self.staleness_exponent >= 0 and self.staleness_exponent < float("inf")):
            raise ValueError(f"buffer.staleness_exponent: finite and >= 0, got {self.staleness_exponent}")
        if self.max_staleness < 0:
            raise ValueError(f"buffer.max_staleness: >= 0, got {self.max_staleness}")
        if not self.max_wait >= 0:
            raise ValueError(f"buffer.max_wait_seconds: >= 0, got {self.max_wait}")
        if not 1 <= self.min_size <= self.size:
            raise ValueError(f"buffer.min_size: in [1, size={self.size}], got {self.min_size}")
        if self.keep_versions < 1:
            raise ValueError(f"buffer.keep_versions: at least 1, got {self.keep_versions}")


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """What a stream is, fixed when it is made: its buffers' aggregation spec (version 0: a template) and its
    buffer policy. JSON is the one form it is kept in (``StreamRecord.spec``)."""

    aggregation: AggregationSpec
    buffer: BufferPolicy

    def to_json(self) -> str:
        return json.dumps({"aggregation": json.loads(self.aggregation.to_json()),
                           "buffer": dataclasses.asdict(self.buffer)})

    @classmethod
    def from_json(cls, text: str) -> StreamSpec:
        spec = json.loads(text)
        return cls(AggregationSpec.from_json(json.dumps(spec["aggregation"])), BufferPolicy(**spec["buffer"]))


def buffer_id(stream_id: str, version: int) -> str:
    """The aggregation id of a stream's buffer of ``version``."""
    return f"{stream_id}.v{version}"


@dataclasses.dataclass
class Slot:
    """A contribution's place: the buffer it goes into, its version, its staleness and weight, its writer id."""

    client: str
    sequence: int
    version: int
    aggregation: Aggregation | None  # (a duplicate of a contribution released: None, its buffer may be gone)
    staleness: int
    weight: float
    writer: str
    duplicate: bool = False


class Participants:
    """The released versions each client of a stream took part in, kept in memory (a stream's ledger is its own:
    only its releases add to it). Every client while they number at most ``limit`` (``complete``: one not here
    took part in none); past that the ``limit`` most recently seen, and a client not here is the store's to say.
    Not thread-safe (the stream's lock guards it).

    >>> p = Participants(limit=2, known={"a": [1]})
    >>> p.get("a"), p.get("b")
    ([1], [])
    >>> p.released(2, ["b", "c"]); p.get("c"), p.complete, p.get("a")
    ([2], False, None)
    """

    def __init__(self, limit: int, known: dict[str, list[int]] | None = None) -> None:
        self.limit = limit
        self._versions: collections.OrderedDict[str, list[int]] = collections.OrderedDict(
            (client, sorted(versions)) for client, versions in (known or {}).items())
        self.complete = len(self._versions) <= limit
        self._trim()
        self.changes = 0  # releases recorded: a read of the store older than one is not kept

    def get(self, client: str) -> list[int] | None:
        """The client's released versions, or None when only the store knows them."""
        versions = self._versions.get(client)
        if versions is not None:
            self._versions.move_to_end(client)
            return list(versions)
        return [] if self.complete else None

    def put(self, client: str, versions: list[int], as_of: int) -> None:
        """What the store says of ``client``, read when ``changes`` was ``as_of`` (kept if nothing changed since)."""
        if as_of == self.changes:
            self._versions[client] = sorted(versions)
            self._trim()

    def released(self, version: int, clients) -> None:
        """``version`` was released with ``clients`` in it."""
        self.changes += 1
        for client in clients:
            known = self.get(client)
            if known is not None:
                self._versions[client] = [*known, version]
        self._trim()

    def _trim(self) -> None:
        while len(self._versions) > self.limit:
            self._versions.popitem(last=False)
            self.complete = False


class BufferedStream:
    """One stream: which buffer fills, who is in which, and its releases (see the module). Thread-safe."""

    def __init__(self, stream_id: str, spec: StreamSpec, lifecycle: Lifecycle, created: float,
                 state: str = OPEN, reason: str = "") -> None:
        self.id, self.spec, self.lifecycle, self.created = stream_id, spec, lifecycle, created
        self.cond = threading.Condition()
        self.state, self.reason = state, reason
        self.version = 0  # the newest version released
        self.filling = 1  # the version the buffer being filled becomes
        self._taken: collections.Counter[int] = collections.Counter()  # contributions taken into each buffer
        self.filling_since = time.monotonic()  # when it took its first (max_wait)
        self._buffers: dict[int, Aggregation] = {}  # the open ones, by version
        self._in_flight: collections.Counter[int] = collections.Counter()  # taken, not yet summed or given up
        self._pending: dict[str, set[int]] = collections.defaultdict(set)  # client -> versions of its contributions
        # in buffers not released yet
        self._claims: set[str] = set()  # clients whose contribution is being taken now
        self._participants = Participants(PARTICIPANTS_IN_MEMORY)  # (from the ledger, at start)
        self._to_release: collections.deque[int] = collections.deque()
        self._released_at: collections.deque[float] = collections.deque(maxlen=10)
        self._stopping = False  # the server stops: the release thread ends
        self._thread: threading.Thread | None = None
        self.last: int | None = None  # the last version its ledger allows (known once the next is refused)
        self._staleness: collections.Counter[int] = collections.Counter()  # accepted contributions by staleness
        # (since this server started)
        self._last_reason = ""

    @property
    def policy(self) -> BufferPolicy:
        return self.spec.buffer

    @property
    def privacy(self) -> dp.PrivacyPolicy:
        privacy = self.spec.aggregation.privacy
        assert privacy is not None  # (a stream has one)
        return privacy

    @property
    def limits(self) -> dp.Participation:
        """How often a client may take part: the ledger's limits, or its correlated noise stream's."""
        limits = participation_limits(self.privacy)
        assert limits is not None  # (a stream's privacy has them)
        return limits

    # Its buffers ---------------------------------------------------------------------------------------
    def start(self, recovered: list[Aggregation]) -> None:
        """Goes on from its buffers as they are (``recovered``: its aggregations, any state), opens the next ones
        and starts its release thread."""
        known = self.lifecycle.store.ledger_participants(self.privacy.ledger_id)
        with self.cond:
            self._participants = Participants(PARTICIPANTS_IN_MEMORY,
                                              {c: [p + 1 for p in positions] for c, positions in known.items()})
            for aggregation in sorted(recovered, key=lambda a: a.spec.version):
                version = aggregation.spec.version
                if aggregation.state is State.FINALIZED:
                    self.version = max(self.version, version)
                elif aggregation.state not in (State.CANCELLED, State.FAILED):
                    self._buffers[version] = aggregation
                    for client in aggregation.totals.clients:
                        self._pending[client_of(client)].add(version)
            self.filling = self.version + 1
            # A buffer that filled before a restart is released first; so is one that is short (contributions
            # taken but not yet durable when the server died) while a later one holds contributions: the clients
            # in that later one may not be able to fill it (their limits), and nothing acknowledged is lost.
            versions = sorted(v for v in self._buffers if v >= self.filling)
            for k, version in enumerate(versions):
                later = any(self._count(self._buffers[v]) for v in versions[k + 1:])
                if version == self.filling and (self._count(self._buffers[version]) >= self.policy.size or later):
                    self._to_release.append(version)
                    self.filling += 1
            for version, aggregation in self._buffers.items():
                if version >= self.filling:
                    self._taken[version] = self._count(aggregation)
        if self.state == OPEN:
            self._open_buffers()
        self._thread = threading.Thread(target=self._releases, name=f"clipd-stream-{self.id}", daemon=True)
        self._thread.start()

    def _count(self, aggregation: Aggregation) -> int:
        return len(aggregation.totals.clients) + aggregation.pending

    def _open_buffers(self) -> None:
        """Makes sure the buffer being filled and the next one exist (the next takes contributions the moment
        the one before is full)."""
        for version in (self.filling, self.filling + 1):
            with self.cond:
                if version in self._buffers or self.state != OPEN or (self.last is not None and version > self.last):
                    continue
            try:
                aggregation = self.lifecycle.create(
                    buffer_id(self.id, version), self.spec.aggregation.layers, self.spec.aggregation.policy,
                    self.spec.aggregation.reject_non_finite, self.spec.aggregation.privacy, Unit.CLIENT,
                    stream=self.id, version=version)
            except FailedPrecondition as e:  # the ledger refuses the buffer (its budget, its noise stream spent)
                with self.cond:
                    if self._buffers or self._to_release:  # the ones before still fill and release: then it stops
                        self.last, self._last_reason = version - 1, f"the ledger refuses version {version}: {e}"
                        self.cond.notify_all()
                        return
                self.stop(f"the ledger refuses version {version}: {e}")
                return
            with self.cond:
                self._buffers[version] = aggregation
                self.cond.notify_all()

    # Contributions -------------------------------------------------------------------------------------
    def take(self, client: str, sequence: int, trained_from: int) -> Slot:
        """The place of the contribution ``sequence`` of ``client`` trained from ``trained_from``: a new slot in
        the buffer being filled, or its earlier one (``duplicate``). Refuses (before any byte is read) a stopped
        stream, a sequence out of order, a stale version or one not released, a client past its limits."""
        client = client_of(client)
        if sequence < 1:
            raise InvalidArgument(f"sequence: a client's contributions are numbered from 1, got {sequence}")
        with self.cond:
            if client in self._claims:
                raise Unavailable(f"a contribution of client {client!r} is being taken: retry",
                                  retry_after=0.05)
            self._claims.add(client)
        try:
            return self._take(client, sequence, trained_from)
        except BaseException:
            with self.cond:
                self._claims.discard(client)
            raise

    def _versions(self, client: str) -> tuple[list[int], set[int]]:
        """The versions a client's contributions count in, ascending (released ones, as the ledger records each
        release's participants, and ones in buffers not released yet), and which of them are not released."""
        with self.cond:
            pending = set(self._pending.get(client, ()))
            released = self._participants.get(client)
            as_of = self._participants.changes
        if released is None:  # (a stream of more clients than it keeps in memory)
            released = [p + 1 for p in self.lifecycle.store.participations(self.privacy.ledger_id, client)]
            with self.cond:
                self._participants.put(client, released, as_of)
                if self._participants.changes != as_of:  # a release meanwhile: read again
                    return self._versions(client)
        return sorted(set(released) | pending), pending - set(released)

    def _take(self, client: str, sequence: int, trained_from: int) -> Slot:
        versions, pending = self._versions(client)
        counted = len(versions)
        if sequence <= counted:  # the client's sequence-th contribution counts in its sequence-th version
            version = versions[sequence - 1]
            with self.cond:
                aggregation = self._buffers.get(version) if version in pending else None
            return Slot(client, sequence, version, aggregation, 0, 1.0, "", duplicate=True)
        if sequence != counted + 1:
            raise FailedPrecondition(f"client {client!r} has {counted} contributions in stream {self.id}: its next is"
                                     f" sequence {counted + 1}, not {sequence}")
        limits = self.limits
        deadline = time.monotonic() + WAIT_FOR_BUFFER
        with self.cond:
            while True:
                self._check_open()
                if trained_from > self.version:
                    raise InvalidArgument(f"trained_from {trained_from}: stream {self.id}'s newest version is"
                                          f" {self.version} (a contribution trains from a released version, or 0:"
                                          " the initial model)")
                if len(versions) >= limits.max_participations:  # never again (the ledger's words)
                    self.lifecycle.ledgers.check_taken(self.privacy, client, [v - 1 for v in versions],
                                                       self.filling - 1)
                # The earliest buffer the client's limits allow: the one filling, or the next (open already).
                version = max(self.filling, versions[-1] + limits.min_separation) if versions else self.filling
                if self.last is not None and version > self.last:
                    raise FailedPrecondition(f"stream {self.id} ends with version {self.last}, the last its ledger"
                                             f" allows ({self._last_reason})")
                ahead = version > self.filling + 1
                # A client whose last contribution is in the next buffer, allowed in the one after, is one release
                # away (it submits faster than the buffers fill): it waits for it, as for a buffer not open yet.
                if ahead and not (version == self.filling + 2 and versions[-1] in pending):
                    self.lifecycle.ledgers.participation_refusals[self.privacy.ledger_id] += 1
                    raise FailedPrecondition(
                        f"client {client!r} takes part in version {versions[-1]} of stream {self.id}; it needs"
                        f" {limits.min_separation} versions between two (min_separation): it may take part again"
                        f" from version {version}")
                if not ahead and version in self._buffers and self._taken[version] < self.policy.size:
                    break
                if not ahead and version in self._buffers:  # the next buffer is full before the one filling
                    raise Unavailable(f"stream {self.id}: version {version}'s buffer is full until version"
                                      f" {self.filling}'s is; retry", retry_after=0.1)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Unavailable(f"stream {self.id}: the buffer of version {version} is not open yet"
                                      + (f" (version {self.filling} is filling)" if ahead else "") + "; retry",
                                      retry_after=1.0)
                self.cond.wait(left)
            tau = buffered.staleness(version, trained_from)
            if tau > self.policy.max_staleness:
                raise FailedPrecondition(f"a contribution trained from version {trained_from} is {tau} versions"
                                         f" stale in stream {self.id}, past its max_staleness"
                                         f" {self.policy.max_staleness}: train from the newest version,"
                                         f" {self.version}")
            self.lifecycle.ledgers.check_taken(self.privacy, client, [v - 1 for v in versions], version - 1)
            aggregation = self._buffers[version]
            self._taken[version] += 1
            self._in_flight[version] += 1
            if version == self.filling and self._taken[version] == 1:
                self.filling_since = time.monotonic()
            while self._taken[self.filling] >= self.policy.size:
                self._flip_locked()
        return Slot(client, sequence, version, aggregation, tau,
                    buffered.staleness_weight(tau, self.policy.staleness_exponent),
                    buffered.trained_from_writer(trained_from))

    @property
    def taken(self) -> int:
        """Contributions taken into the buffer being filled."""
        with self.cond:
            return self._taken[self.filling]

    def buffer(self) -> Aggregation:
        """The buffer being filled (waiting a while for it to open); ``FailedPrecondition`` once stopped."""
        with self.cond:
            self.cond.wait_for(lambda: self.filling in self._buffers or self.state != OPEN, WAIT_FOR_BUFFER)
            self._check_open()
            aggregation = self._buffers.get(self.filling)
        if aggregation is None:
            raise Unavailable(f"stream {self.id}: the buffer of version {self.filling} is not open yet; retry",
                              retry_after=1.0)
        return aggregation

    def summed(self, slot: Slot) -> None:
        """The slot's contribution is in its buffer (accepted: it is summed before the buffer is released)."""
        with self.cond:
            self._pending[slot.client].add(slot.version)
            self._staleness[slot.staleness] += 1

    def done(self, slot: Slot) -> None:
        """The slot's call is over (its contribution in, or given up)."""
        with self.cond:
            self._claims.discard(slot.client)
            if not slot.duplicate:
                self._in_flight[slot.version] -= 1
            self.cond.notify_all()

    def _flip_locked(self) -> None:
        """The buffer being filled is full: the next one takes what comes; this one is released once its
        contributions are in."""
        self._to_release.append(self.filling)
        self._taken.pop(self.filling, None)
        self.filling += 1
        self.filling_since = time.monotonic()
        self.cond.notify_all()

    def _check_open(self) -> None:
        if self.state != OPEN:
            raise FailedPrecondition(f"stream {self.id} stopped: {self.reason}")

    # Releases --------------------------------------------------------------------------------------------
    def _releases(self) -> None:
        """The stream's release thread: each full buffer, in version order, once its contributions are summed;
        a buffer past max_wait with min_size contributions; the next buffers opened."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self._to_release or self._due() or self._stopping, self._tick())
                if self._stopping and not self._to_release:
                    return
                if not self._to_release and self._due():
                    self._flip_locked()
                version = self._to_release[0] if self._to_release else None
            self._open_buffers()
            if version is None:
                continue
            self._wait_summed(version)
            self._release(version)
            with self.cond:
                self._to_release.popleft()
                ended = self.last is not None and self.version >= self.last
            if ended:
                self.stop(f"version {self.last} was its last: {self._last_reason}")

    def _wait_summed(self, version: int) -> None:
        """Until every contribution taken into ``version``'s buffer is in it (or given up)."""
        with self.cond:
            self.cond.wait_for(lambda: self._in_flight[version] <= 0)

    def _tick(self) -> float | None:
        return min(1.0, self.policy.max_wait) if self.policy.max_wait > 0 else None

    def _due(self) -> bool:
        """A buffer that has waited max_wait with at least min_size contributions (taken, summed by release)."""
        return (self.policy.max_wait > 0 and self._taken[self.filling] >= self.policy.min_size and self.state == OPEN
                and time.monotonic() - self.filling_since >= self.policy.max_wait)

    def _release(self, version: int) -> None:
        aggregation_id = buffer_id(self.id, version)
        try:
            self.lifecycle.finalize(aggregation_id)
        except FailedPrecondition as e:  # the ledger refused it (its budget): nothing released, the stream stops
            self.stop(f"version {version} was not released: {e}")
            return
        except Exception as e:  # a buffer that failed (its checkpoint, its device): the stream can't go on in order
            log.exception("stream %s: releasing version %d failed", self.id, version)
            self.stop(f"version {version} was not released: {type(e).__name__}: {e}")
            return
        with self.cond:
            self.version = version
            self._buffers.pop(version, None)
            participants = [c for c, versions in self._pending.items() if version in versions]
            for client in participants:
                self._pending[client].discard(version)
                if not self._pending[client]:
                    del self._pending[client]
            self._participants.released(version, participants)
            self._released_at.append(time.monotonic())
            self.cond.notify_all()
        event(log, "stream.released", stream=self.id, version=version)
        old = version - self.policy.keep_versions
        if old >= 1:
            try:
                self.lifecycle.cancel(buffer_id(self.id, old))  # its release and record go; the ledger keeps its entry
            except NotFound:
                pass

    def stop(self, reason: str) -> None:
        """Takes no more contributions; its buffers not released are dropped (their releases never made)."""
        with self.cond:
            if self.state != OPEN:
                return
            self.state, self.reason = STOPPED, reason
            open_versions = [v for v in self._buffers if v not in self._to_release]
            self.cond.notify_all()
        self.lifecycle.store.set_stream_state(self.id, STOPPED, reason)
        event(log, "stream.stopped", logging.WARNING, stream=self.id, reason=reason)
        for version in open_versions:
            try:
                self.lifecycle.cancel(buffer_id(self.id, version))
            except NotFound:
                pass
            with self.cond:
                self._buffers.pop(version, None)

    def close(self) -> None:
        """The server stops: its release thread ends once the releases due are made."""
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(30.0)

    # What it shows ------------------------------------------------------------------------------------
    def releases_per_minute(self) -> float:
        with self.cond:
            times = list(self._released_at)
        if len(times) < 2:
            return 0.0
        return 60.0 * (len(times) - 1) / max(1e-9, times[-1] - times[0])

    def describe(self) -> dict:
        """The stream as plain data (the admin API's view): its state, newest version, the open buffer's fill,
        its rules, releases per minute and its accepted contributions by staleness since this server started."""
        limits, correlated = self.limits, self.privacy.correlated
        with self.cond:
            staleness = dict(sorted(self._staleness.items()))
            described = {
                "stream_id": self.id, "state": self.state, "reason": self.reason, "created_unix_seconds": self.created,
                "ledger_id": self.privacy.ledger_id,
                "mechanism": correlated.mechanism.value if correlated is not None else "independent",
                "version": self.version, "filling_version": self.filling, "last_version": self.last,
                "buffer": {"size": self.policy.size, "filled": self._taken[self.filling] if self.state == OPEN else 0,
                           "min_size": self.policy.min_size, "max_wait_seconds": self.policy.max_wait,
                           "keep_versions": self.policy.keep_versions},
                "participation": {"max_participations": limits.max_participations,
                                  "min_separation": limits.min_separation}}
        contributions = sum(staleness.values())
        described["releases_per_minute"] = self.releases_per_minute()
        described["staleness"] = {
            "exponent": self.policy.staleness_exponent, "max": self.policy.max_staleness,
            "contributions": contributions, "by_staleness": {str(t): n for t, n in staleness.items()},
            "mean": sum(t * n for t, n in staleness.items()) / contributions if contributions else None}
        return described

    def release(self, version: int) -> Aggregation:
        """The kept buffer of a released version (``NotFound`` if it is not released, or no longer kept)."""
        if not 1 <= version <= self.version:
            raise NotFound(f"stream {self.id} has released versions 1 to {self.version}, not {version}")
        try:
            aggregation = self.lifecycle.registry.get(buffer_id(self.id, version))
        except NotFound:
            raise NotFound(f"stream {self.id} keeps its last {self.policy.keep_versions} versions: {version} is"
                           " gone") from None
        if aggregation.result is None:
            raise NotFound(f"stream {self.id}: version {version} has no release to show")
        return aggregation

    def wait_for(self, version: int, timeout: float) -> bool:
        """Waits until ``version`` is released or the stream stops; whether it is."""
        with self.cond:
            self.cond.wait_for(lambda: self.version >= version or self.state != OPEN, timeout)
            return self.version >= version

    def client(self, client_id: str) -> dict:
        """What the stream has of one client: its contributions, the versions they count in, its next sequence
        and the first version it may take part in again (0: its limit is reached)."""
        client = client_of(client_id)
        versions, _ = self._versions(client)
        with self.cond:
            filling = self.filling
        limits = self.limits
        if len(versions) >= limits.max_participations:
            allowed = 0
        else:
            allowed = max(filling, versions[-1] + limits.min_separation) if versions else filling
        return {"client_id": client, "contributions": len(versions), "next_sequence": len(versions) + 1,
                "versions": versions, "may_contribute_from": allowed}


class Streams:
    """The server's buffered streams (see the module)."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle
        self._lock = threading.Lock()
        self._streams: dict[str, BufferedStream] = {}

    def create(self, stream_id: str, layers, policy: ClipPolicy, reject: bool, privacy: dp.PrivacyPolicy | None,
               buffer: BufferPolicy) -> BufferedStream:
        """The stream ``stream_id`` (a new id if empty), made and durable, its first buffers open; the same one
        for a request that repeats it; ``AlreadyExists`` for another spec under that id; ``InvalidArgument``
        for a stream the server can't run."""
        check_stream_privacy(privacy)
        assert privacy is not None
        template = AggregationSpec(tuple(layers), policy, reject, privacy, 1, Unit.CLIENT, stream=stream_id or "?")
        stream_id = stream_id or f"stream-{uuid.uuid4().hex[:16]}"
        spec = StreamSpec(dataclasses.replace(template, stream=stream_id), buffer)
        with self._lock:
            existing = self._streams.get(stream_id)
            if existing is not None:
                if existing.spec != spec:
                    raise AlreadyExists(f"stream {stream_id!r} exists with another spec")
                return existing
            record = StreamRecord(stream_id, spec.to_json(), time.time())
            if not self.lifecycle.store.create_stream(record):
                raise AlreadyExists(f"stream {stream_id!r} exists in the store")
            stream = self._streams[stream_id] = BufferedStream(stream_id, spec, self.lifecycle, record.created)
        event(log, "stream.created", stream=stream_id, size=buffer.size, ledger=privacy.ledger_id)
        stream.start([])
        return stream

    def get(self, stream_id: str) -> BufferedStream:
        with self._lock:
            stream = self._streams.get(stream_id)
        if stream is None:
            raise NotFound(f"no stream {stream_id!r}")
        return stream

    def all(self) -> list[BufferedStream]:
        with self._lock:
            return list(self._streams.values())

    def recover(self) -> None:
        """Brings back every stream of the store, each from its buffers as they are (after the aggregations are
        recovered)."""
        by_stream: dict[str, list[Aggregation]] = collections.defaultdict(list)
        for aggregation in self.lifecycle.registry.all():
            if aggregation.spec.stream:
                by_stream[aggregation.spec.stream].append(aggregation)
        for record in self.lifecycle.store.streams():
            stream = BufferedStream(record.stream_id, StreamSpec.from_json(record.spec), self.lifecycle,
                                    record.created, record.state, record.reason)
            with self._lock:
                self._streams[record.stream_id] = stream
            stream.start(by_stream.get(record.stream_id, []))

    def stop(self) -> None:
        for stream in self.all():
            stream.close()


def check_stream_privacy(privacy: dp.PrivacyPolicy | None) -> None:
    """``InvalidArgument`` unless a stream can release under ``privacy``: a policy with participation limits
    the server enforces (independent noise, or a correlated noise stream's (k, b); a client's privacy is how often
    it takes part)."""
    if privacy is None:
        raise InvalidArgument("a buffered stream needs a privacy policy (each release is noised and accounted on"
                              " its ledger)")
    if privacy.correlated is not None and privacy.correlated.declared:
        raise InvalidArgument("a buffered stream enforces its clients' participation itself: correlated noise with"
                              " declared participation is for a trainer's own steps (declared_participation=False)")
    if participation_limits(privacy) is None:
        raise InvalidArgument("a buffered stream needs participation limits (Privacy(..., max_participations=k,"
                              " min_separation=b)): asynchronous clients are not sampled, and their privacy is how"
                              " often each may take part")
    if privacy.adaptive is not None or privacy.metrics_noise_multiplier > 0:
        raise InvalidArgument("a buffered stream releases its sums alone: no adaptive clipping or released"
                              " statistics yet")


def iter_releases(stream: BufferedStream, after: int, alive: Callable[[], bool]) -> Iterator[Aggregation]:
    """The stream's released buffers after version ``after``, each as it is made, while ``alive()`` and the
    stream is open (the kept ones first)."""
    version = after + 1
    while alive():
        if stream.wait_for(version, 1.0):
            yield stream.release(version)
            version += 1
        elif stream.state != OPEN and stream.version < version:
            return
