"""Where aggregations outlive the process: their specs, lifecycle and checkpointed partial states.

A checkpoint is a :class:`~clipd.engine.PartialState`: the float64/int64 totals
and, for each client, the highest sequence number they hold. The client marks
live inside the checkpointed blob, never beside it, so a store that falls back
to an older checkpoint (the newest is corrupt) can never pair old sums with
newer sequence numbers.

This module owns the contract (:class:`Store`, its records and errors) and
:class:`MemoryStore`: in this process only (``data_dir = "memory"``): nothing
survives a restart; for benchmarks and for callers that do not want disk. The
durable stores are SQL (:mod:`.sql`): :class:`~clipd.server.stores.sqlite.SQLiteStore`
(one machine, crash-safe) and :class:`~clipd.server.stores.postgres.PostgresStore`
(shared by processes and hosts); :func:`clipd.server.stores.open_store` picks one.

Every implementation passes the same contract tests (``StoreContract`` in ``tests/test_store.py``).
"""

from __future__ import annotations

import abc
import dataclasses
import secrets
import threading
from collections.abc import Sequence

from clipd.engine import PartialState

OPEN, FINALIZED, FAILED = "open", "finalized", "failed"
CLOSING = "closing"  # shard processes: no more batches; their final checkpoints are being committed
STATES = (OPEN, CLOSING, FINALIZED, FAILED)


@dataclasses.dataclass(frozen=True)
class AggregationRecord:
    """What the store knows of one aggregation besides its checkpoints."""

    aggregation_id: str
    spec: str  # JSON: what the aggregation is (aggregations.AggregationSpec.to_json); opaque to the store
    state: str = OPEN  # one of STATES
    created: float = 0.0  # unix seconds
    finished: float | None = None  # unix seconds it was finalized or failed
    reason: str = ""  # why it failed


@dataclasses.dataclass(frozen=True)
class LedgerRecord:
    """A privacy ledger: releases accounted together. ``config`` is JSON, opaque to the store."""

    ledger_id: str
    config: str  # accountant, neighbouring relation, delta, max_epsilon (see clipd/server/privacy.py)
    created: float = 0.0


@dataclasses.dataclass(frozen=True)
class StreamRecord:
    """A buffered stream (``server.streams``): its spec (JSON, opaque to the store), when it was made, and whether it
    takes contributions (``open``) or stopped (``stopped``, with the reason). Its buffers are aggregations."""

    stream_id: str
    spec: str
    created: float = 0.0
    state: str = "open"
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """One accounted event of a ledger: a release, or a debug aggregation's non-private event."""

    aggregation_id: str
    event: str  # the DpEvent as JSON (engine.event_to_json)
    time: float  # unix seconds
    epsilon_after: float  # the ledger's epsilon once this entry is in (at its delta)
    next_bound: float | None = None  # adaptive clipping: the bound after this release


@dataclasses.dataclass(frozen=True)
class NoiseStream:
    """A ledger's correlated noise stream as of its last release: how many releases it noised and the
    mechanism's state after them (its buffers, in the engine's container format; opaque to the store)."""

    releases: int
    state: bytes


@dataclasses.dataclass(frozen=True)
class AuditRecord:
    """A ledger's canary audit as the store keeps it: its state (``server.audit.AuditState``) and whether it is
    closed (a closed one is never replaced by a release's commit: a close is final)."""

    state: bytes
    closed: bool = False


class LedgerConflict(Exception):
    """The ledger gained an entry since the caller read it (another process released on it)."""


class FencedOut(Exception):
    """A newer owner claimed the shard (a higher epoch): this owner's checkpoint is refused.

    An owner believed dead (a stopped process, a partitioned actor) may still
    run; once a replacement has claimed the shard, nothing the old one writes
    may land, or two owners would both count the shard's batches.
    """


def check_state(state: str) -> None:
    """``ValueError`` unless ``state`` is one of :data:`STATES`."""
    if state not in STATES:
        raise ValueError(f"unknown state {state!r} (one of {STATES})")


class Store(abc.ABC):
    """The durable half of the server. Every method is thread-safe; every write is durable on return."""

    durable: bool = True  # False for MemoryStore: nothing survives the process
    shared: bool = False  # True where several servers may open it at once: shard owners then claim epochs

    @abc.abstractmethod
    def create(self, record: AggregationRecord, *, ledger_entry: tuple[str, LedgerEntry] | None = None) -> bool:
        """Adds an aggregation; False (and nothing changes) if its id exists.

        ``ledger_entry``: ``(ledger_id, entry)`` appended to that (existing)
        ledger in the same commit (a debug aggregation's non-private event).
        """

    @abc.abstractmethod
    def records(self) -> list[AggregationRecord]:
        """Every aggregation, oldest first."""

    @abc.abstractmethod
    def get(self, aggregation_id: str) -> AggregationRecord | None:
        """One aggregation's record, or None (shard processes read it to open what they are routed)."""

    @abc.abstractmethod
    def set_state(self, aggregation_id: str, state: str, *, reason: str = "",
                  finished: float | None = None) -> None:
        """Moves an aggregation to ``state`` (``KeyError`` if it does not exist)."""

    @abc.abstractmethod
    def save_checkpoint(self, aggregation_id: str, partial: PartialState, *, shard: int = 0,
                        epoch: int | None = None) -> None:
        """Commits ``partial`` as the newest checkpoint of one shard of the aggregation.

        Each shard (``0 <= shard``) has checkpoints of its own. ``epoch``: the
        epoch the writer claimed with :meth:`claim_shard`; ``FencedOut`` (and
        nothing written) if the shard has been claimed since. None: no check
        (a single owner, such as the one process of an embedded store).
        ``KeyError`` if the aggregation does not exist.
        """

    @abc.abstractmethod
    def load_checkpoint(self, aggregation_id: str, *, shard: int = 0,
                        newest_only: bool = False) -> PartialState | None:
        """The shard's newest checkpoint that reads back intact (an older one if the newest is corrupt), or None.

        ``newest_only``: None rather than an older checkpoint (a finalized result
        must be the final state, never an earlier one).
        """

    @abc.abstractmethod
    def claim_shard(self, aggregation_id: str, shard: int) -> int:
        """Makes the caller the shard's owner: returns its new epoch (1, 2, ...), durably.

        Every earlier owner's :meth:`save_checkpoint` is refused from then on
        (``FencedOut``). ``KeyError`` if the aggregation does not exist.
        """

    @abc.abstractmethod
    def submit_token_key(self) -> bytes:
        """The 32-byte key the server signs submit tokens with: made once, the same for every process."""

    @abc.abstractmethod
    def delete(self, aggregation_id: str) -> None:
        """Forgets an aggregation and its checkpoints (no error if it does not exist)."""

    # Privacy ledgers ----------------------------------------------------------------------
    @abc.abstractmethod
    def ensure_ledger(self, record: LedgerRecord) -> LedgerRecord:
        """The stored ledger of this id: ``record`` if it was absent (then added, durably)."""

    @abc.abstractmethod
    def ledgers(self) -> list[LedgerRecord]: ...

    @abc.abstractmethod
    def ledger_entries(self, ledger_id: str, start: int = 0) -> list[LedgerEntry]:
        """The ledger's entries in the order they were committed, from the ``start``-th on ([] if it does
        not exist). Entries are never removed nor changed: what was read once stays true."""

    @abc.abstractmethod
    def commit_release(self, aggregation_id: str, release: bytes, ledger_id: str, entry: LedgerEntry,
                       position: int, finished: float, *, stream: NoiseStream | None = None,
                       participants: Sequence[str] = (), audit: AuditRecord | None = None,
                       record: AggregationRecord | None = None, drop: str = "") -> None:
        """One transaction: the release kept, ``entry`` appended, the aggregation FINALIZED.

        ``position``: the number of entries the caller saw; ``LedgerConflict``
        (and nothing written) if the ledger has another number. The raw
        checkpoints go: only the release is kept. ``KeyError`` if the
        aggregation or the ledger does not exist. ``stream``: the ledger's noise
        stream after this release (it replaces the one before); ``participants``:
        the clients that took part in it, recorded at ``position``; ``audit``: the
        ledger's audit after this release (it replaces the one before, unless that one is closed).
        ``record``: the aggregation's, added first (a DP-SGD step's is stored with its release; ``KeyError`` if
        its id exists); ``drop``: another aggregation forgotten in the same transaction, as :meth:`delete` does
        (the trainer's step before).
        """

    @abc.abstractmethod
    def ledger_audit(self, ledger_id: str) -> bytes | None:
        """The ledger's canary audit state (``server.audit.AuditState``), or None: it has no audit."""

    @abc.abstractmethod
    def save_ledger_audit(self, ledger_id: str, audit: AuditRecord, *, create: bool = False) -> bytes:
        """Stores the ledger's audit, durably, unless the stored one is closed; returns the stored state.
        ``create``: only if it has none (then the one it has is returned): two processes that open an audit at
        once agree on one."""

    @abc.abstractmethod
    def noise_stream(self, ledger_id: str) -> NoiseStream | None:
        """The ledger's noise stream as of its last release (None: no release made one yet)."""

    @abc.abstractmethod
    def participations(self, ledger_id: str, client: str) -> list[int]:
        """The ledger positions of the releases ``client`` took part in, in order."""

    @abc.abstractmethod
    def ledger_participants(self, ledger_id: str) -> dict[str, list[int]]:
        """Every client of the ledger's releases, with the positions of those it took part in, in order."""

    @abc.abstractmethod
    def load_release(self, aggregation_id: str) -> bytes | None:
        """The committed release of an aggregation, or None."""

    # Buffered streams ------------------------------------------------------------------------
    @abc.abstractmethod
    def create_stream(self, record: StreamRecord) -> bool:
        """Adds a buffered stream, durably; False (and nothing changes) if its id exists."""

    @abc.abstractmethod
    def streams(self) -> list[StreamRecord]:
        """Every buffered stream, oldest first."""

    @abc.abstractmethod
    def set_stream_state(self, stream_id: str, state: str, reason: str = "") -> None:
        """Moves a stream to ``state`` (``open`` or ``stopped``), durably (``KeyError`` if it does not exist)."""

    def close(self) -> None:  # noqa: B027 (a store with nothing to release keeps this)
        """Releases files and connections."""


class MemoryStore(Store):
    """A store in this process's memory: the same contract, minus surviving a restart."""

    durable = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, AggregationRecord] = {}
        self._checkpoints: dict[tuple[str, int], PartialState] = {}
        self._ledgers: dict[str, LedgerRecord] = {}
        self._entries: dict[str, list[LedgerEntry]] = {}
        self._streams: dict[str, NoiseStream] = {}
        self._participations: dict[tuple[str, str], list[int]] = {}
        self._audits: dict[str, AuditRecord] = {}
        self._releases: dict[str, bytes] = {}
        self._epochs: dict[tuple[str, int], int] = {}
        self._buffered: dict[str, StreamRecord] = {}
        self._key = secrets.token_bytes(32)

    def create(self, record: AggregationRecord, *, ledger_entry: tuple[str, LedgerEntry] | None = None) -> bool:
        with self._lock:
            if record.aggregation_id in self._records:
                return False
            if ledger_entry is not None and ledger_entry[0] not in self._ledgers:
                raise KeyError(ledger_entry[0])
            self._records[record.aggregation_id] = record
            if ledger_entry is not None:
                self._entries[ledger_entry[0]].append(ledger_entry[1])
            return True

    def records(self) -> list[AggregationRecord]:
        with self._lock:
            return sorted(self._records.values(), key=lambda r: r.created)

    def get(self, aggregation_id: str) -> AggregationRecord | None:
        with self._lock:
            return self._records.get(aggregation_id)

    def set_state(self, aggregation_id: str, state: str, *, reason: str = "",
                  finished: float | None = None) -> None:
        check_state(state)
        with self._lock:
            record = self._records[aggregation_id]
            self._records[aggregation_id] = dataclasses.replace(record, state=state, reason=reason,
                                                                finished=finished)

    def save_checkpoint(self, aggregation_id: str, partial: PartialState, *, shard: int = 0,
                        epoch: int | None = None) -> None:
        with self._lock:
            if aggregation_id not in self._records:
                raise KeyError(aggregation_id)
            current = self._epochs.get((aggregation_id, shard), 0)
            if epoch is not None and epoch != current:
                raise FencedOut(f"aggregation {aggregation_id!r} shard {shard}: epoch {epoch} was"
                                f" replaced by {current}")
            self._checkpoints[(aggregation_id, shard)] = partial

    def load_checkpoint(self, aggregation_id: str, *, shard: int = 0,
                        newest_only: bool = False) -> PartialState | None:
        with self._lock:
            return self._checkpoints.get((aggregation_id, shard))

    def claim_shard(self, aggregation_id: str, shard: int) -> int:
        with self._lock:
            if aggregation_id not in self._records:
                raise KeyError(aggregation_id)
            epoch = self._epochs.get((aggregation_id, shard), 0) + 1
            self._epochs[(aggregation_id, shard)] = epoch
            return epoch

    def submit_token_key(self) -> bytes:
        return self._key

    def delete(self, aggregation_id: str) -> None:
        with self._lock:
            self._delete_locked(aggregation_id)

    def _delete_locked(self, aggregation_id: str) -> None:
        self._records.pop(aggregation_id, None)
        self._releases.pop(aggregation_id, None)
        for key in [k for k in (*self._checkpoints, *self._epochs) if k[0] == aggregation_id]:
            self._checkpoints.pop(key, None)
            self._epochs.pop(key, None)

    def ensure_ledger(self, record: LedgerRecord) -> LedgerRecord:
        with self._lock:
            self._entries.setdefault(record.ledger_id, [])
            return self._ledgers.setdefault(record.ledger_id, record)

    def ledgers(self) -> list[LedgerRecord]:
        with self._lock:
            return sorted(self._ledgers.values(), key=lambda r: r.created)

    def ledger_entries(self, ledger_id: str, start: int = 0) -> list[LedgerEntry]:
        with self._lock:
            return list(self._entries.get(ledger_id, [])[start:])

    def commit_release(self, aggregation_id: str, release: bytes, ledger_id: str, entry: LedgerEntry,
                       position: int, finished: float, *, stream: NoiseStream | None = None,
                       participants: Sequence[str] = (), audit: AuditRecord | None = None,
                       record: AggregationRecord | None = None, drop: str = "") -> None:
        with self._lock:
            if record is not None and aggregation_id in self._records:
                raise KeyError(f"aggregation {aggregation_id!r} exists")
            record = record or self._records[aggregation_id]
            entries = self._entries[ledger_id]
            if len(entries) != position:
                raise LedgerConflict(f"ledger {ledger_id!r} has {len(entries)} entries, not {position}")
            if drop:
                self._delete_locked(drop)
            entries.append(entry)
            if stream is not None:
                self._streams[ledger_id] = stream
            if audit is not None:
                self._put_audit_locked(ledger_id, audit)
            for client in participants:
                self._participations.setdefault((ledger_id, client), []).append(position)
            self._releases[aggregation_id] = release
            for key in [k for k in self._checkpoints if k[0] == aggregation_id]:
                del self._checkpoints[key]
            self._records[aggregation_id] = dataclasses.replace(record, state=FINALIZED, finished=finished)

    def load_release(self, aggregation_id: str) -> bytes | None:
        with self._lock:
            return self._releases.get(aggregation_id)

    def create_stream(self, record: StreamRecord) -> bool:
        with self._lock:
            if record.stream_id in self._buffered:
                return False
            self._buffered[record.stream_id] = record
            return True

    def streams(self) -> list[StreamRecord]:
        with self._lock:
            return sorted(self._buffered.values(), key=lambda r: r.created)

    def set_stream_state(self, stream_id: str, state: str, reason: str = "") -> None:
        with self._lock:
            self._buffered[stream_id] = dataclasses.replace(self._buffered[stream_id], state=state, reason=reason)
    def ledger_audit(self, ledger_id: str) -> bytes | None:
        with self._lock:
            stored = self._audits.get(ledger_id)
            return stored.state if stored is not None else None

    def save_ledger_audit(self, ledger_id: str, audit: AuditRecord, *, create: bool = False) -> bytes:
        with self._lock:
            if not (create and ledger_id in self._audits):
                self._put_audit_locked(ledger_id, audit)
            return self._audits[ledger_id].state

    def _put_audit_locked(self, ledger_id: str, audit: AuditRecord) -> None:
        stored = self._audits.get(ledger_id)
        if stored is None or not stored.closed:
            self._audits[ledger_id] = AuditRecord(bytes(audit.state), audit.closed)

    def noise_stream(self, ledger_id: str) -> NoiseStream | None:
        with self._lock:
            return self._streams.get(ledger_id)

    def participations(self, ledger_id: str, client: str) -> list[int]:
        with self._lock:
            return list(self._participations.get((ledger_id, client), []))

    def ledger_participants(self, ledger_id: str) -> dict[str, list[int]]:
        with self._lock:
            return {client: list(positions) for (ledger, client), positions in self._participations.items()
                    if ledger == ledger_id}

