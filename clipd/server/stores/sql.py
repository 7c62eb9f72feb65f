"""What the two durable stores share: one SQL schema's logic, written once for SQLite and PostgreSQL.

:class:`SQLStore` owns the rows (aggregations, checkpoint generations, shard
epochs, releases, privacy ledgers) and every statement that reads or writes
them, written with ``?`` placeholders: creating and finalizing, fencing by
epoch, the two newest generations kept per shard, the fallback to the newest
checkpoint that reads back intact, ledger appends at a position, schema
upgrades. A dialect (:mod:`.sqlite`, :mod:`.postgres`) supplies what differs:

- its connection and transactions (:meth:`SQLStore._connection`,
  :meth:`SQLStore._atomic`), its placeholder and its row locks
  (``FOR_UPDATE``, ``FOR_SHARE``; SQLite has none: ``BEGIN IMMEDIATE`` holds
  the whole database);
- its schema (``MIGRATIONS``) and where it keeps the version;
- where blobs live. By default in their rows; SQLite keeps them in files and
  overrides the methods that write, read and drop them;
- the submit-token key and closing.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from clipd.engine import CorruptStateError, PartialState
from clipd.server.stores.base import (
    FINALIZED,
    AggregationRecord,
    AuditRecord,
    FencedOut,
    LedgerConflict,
    LedgerEntry,
    LedgerRecord,
    NoiseStream,
    Store,
    StreamRecord,
    check_state,
)

KEEP_GENERATIONS = 2  # checkpoints kept per shard: the newest and the one before

NEXT_GENERATION = "SELECT COALESCE(MAX(generation), 0) + 1 FROM checkpoints WHERE aggregation = ?"
_RECORDS = "SELECT id, spec, state, created, finished, reason FROM aggregations"
_OLD_GENERATIONS = (  # a shard's rows beyond its newest ones; (key, shard, key, shard, KEEP_GENERATIONS)
    "aggregation = ? AND shard = ? AND generation <= (SELECT generation FROM checkpoints"
    " WHERE aggregation = ? AND shard = ? ORDER BY generation DESC LIMIT 1 OFFSET ?)")

_LEDGER_TABLES = (
    """CREATE TABLE ledgers (
        id {text} PRIMARY KEY,
        config {text} NOT NULL,
        created {real} NOT NULL
    )""",
    """CREATE TABLE ledger_entries (  -- never deleted: privacy spent stays spent
        ledger {text} NOT NULL REFERENCES ledgers (id),
        position {integer} NOT NULL,
        aggregation_id {text} NOT NULL,  -- not a reference: the aggregation may be deleted
        event {text} NOT NULL,
        time {real} NOT NULL,
        epsilon_after {real} NOT NULL,
        next_bound {real},
        PRIMARY KEY (ledger, position)
    )""",
)


def ledger_tables(*, text: str, integer: str, real: str) -> tuple[str, ...]:
    """``CREATE TABLE`` of the ledgers and their entries (the same in both dialects, but for column types)."""
    return tuple(statement.format(text=text, integer=integer, real=real) for statement in _LEDGER_TABLES)


_STREAM_TABLES = (
    """CREATE TABLE ledger_streams (  -- a ledger's correlated noise stream after its last release
        ledger {text} PRIMARY KEY REFERENCES ledgers (id),
        releases {integer} NOT NULL,
        nbytes {integer} NOT NULL,
        crc32 {integer} NOT NULL,
        state {blob} NOT NULL
    )""",
    """CREATE TABLE ledger_participations (  -- never deleted: which releases each client took part in
        ledger {text} NOT NULL REFERENCES ledgers (id),
        client {text} NOT NULL,
        position {integer} NOT NULL,
        PRIMARY KEY (ledger, client, position)
    )""",
)


def stream_tables(*, text: str, integer: str, blob: str) -> tuple[str, ...]:
    """``CREATE TABLE`` of the ledgers' noise streams and participations (both dialects)."""
    return tuple(statement.format(text=text, integer=integer, blob=blob) for statement in _STREAM_TABLES)


_AUDIT_TABLES = (
    """CREATE TABLE ledger_audits (  -- a ledger's canary audit (server.audit.AuditState) after its last change
        ledger {text} PRIMARY KEY REFERENCES ledgers (id),
        nbytes {integer} NOT NULL,
        crc32 {integer} NOT NULL,
        state {blob} NOT NULL,
        closed {integer} NOT NULL  -- 1 once closed: a release's commit no longer replaces it
    )""",
)


def audit_tables(*, text: str, integer: str, blob: str) -> tuple[str, ...]:
    """``CREATE TABLE`` of the ledgers' canary audits (both dialects)."""
    return tuple(statement.format(text=text, integer=integer, blob=blob) for statement in _AUDIT_TABLES)


_BUFFERED_STREAM_TABLES = (
    """CREATE TABLE buffered_streams (  -- a buffered stream's spec and state (its buffers are aggregations)
        id {text} PRIMARY KEY,
        spec {text} NOT NULL,
        created {real} NOT NULL,
        state {text} NOT NULL,
        reason {text} NOT NULL
    )""",
)


def buffered_stream_tables(*, text: str, real: str) -> tuple[str, ...]:
    """``CREATE TABLE`` of the buffered streams (both dialects)."""
    return tuple(statement.format(text=text, real=real) for statement in _BUFFERED_STREAM_TABLES)


_UPSERT_AUDIT = ("INSERT INTO ledger_audits (ledger, nbytes, crc32, state, closed) VALUES (?, ?, ?, ?, ?)"
                 " ON CONFLICT (ledger) DO UPDATE SET nbytes = excluded.nbytes, crc32 = excluded.crc32,"
                 " state = excluded.state, closed = excluded.closed WHERE ledger_audits.closed = 0")


def checked(blob: bytes, nbytes: int, crc: int, what: str) -> bytes:
    """``blob`` if its size and CRC-32 match its row; ``CorruptStateError`` otherwise."""
    if len(blob) != nbytes:
        raise CorruptStateError(f"{what}: {len(blob)} bytes, the row says {nbytes}")
    if zlib.crc32(blob) != crc:
        raise CorruptStateError(f"{what}: CRC-32 differs from the row's")
    return blob


class Tx:
    """Statements on one connection (in a transaction, or one read), written with ``?`` placeholders."""

    __slots__ = ("_placeholder", "conn")

    def __init__(self, conn: Any, placeholder: str) -> None:
        self.conn, self._placeholder = conn, placeholder

    def execute(self, sql: str, params: tuple = ()) -> Any:
        """The cursor of ``sql``, its ``?`` written as the dialect's placeholder."""
        if self._placeholder != "?":
            sql = sql.replace("?", self._placeholder)
        return self.conn.execute(sql, params)

    def one(self, sql: str, params: tuple = ()) -> tuple | None:
        return self.execute(sql, params).fetchone()

    def row(self, sql: str, params: tuple = ()) -> tuple:
        """The row of a query that always returns one (an aggregate, a row this transaction wrote or found)."""
        row = self.one(sql, params)
        assert row is not None, sql
        return row

    def all(self, sql: str, params: tuple = ()) -> list[tuple]:
        return self.execute(sql, params).fetchall()


class SQLStore(Store):
    """A :class:`Store` in SQL tables: every method's logic; the dialect's connection, schema and blobs aside.

    One connection, guarded by ``_db_lock`` (held only while SQL runs); every
    write is one transaction (:meth:`_transaction`), durable when it returns.
    ``_files_lock`` serializes the methods that touch blobs outside the
    database (none here; SQLite's files); lock order: files, then database.
    """

    log = logging.getLogger(__name__)  # a dialect's: its module's logger
    SCHEMA_VERSION: int
    MIGRATIONS: tuple[tuple[str, ...], ...] = ()  # [k]: the statements taking version k to k + 1
    PLACE = "database"  # what else to use when the schema is newer than this code
    PLACEHOLDER = "?"
    FOR_UPDATE = FOR_SHARE = ""  # row locks, where the dialect has them (appended to a SELECT)
    LEDGER_ORDER = "created, id"
    CHECKPOINT_PAYLOAD = "blob"  # the column that holds a checkpoint's blob (or where it is)
    RELEASE_COLUMNS: tuple[str, ...] = ("nbytes", "crc32", "blob")  # what a release's row holds besides its aggregation
    UNIQUE_VIOLATION: tuple[type[Exception], ...] = ()  # raised where a ledger position was taken
    UNREADABLE: tuple[type[Exception], ...] = (CorruptStateError,)  # raised reading a damaged checkpoint
    FENCED = "aggregation {aggregation_id!r} shard {shard}: epoch {epoch} was replaced by {current}"
    _files_lock: contextlib.AbstractContextManager = contextlib.nullcontext()
    _where = ""  # the store's name in the message of a newer schema

    def __init__(self) -> None:
        self._db_lock = threading.Lock()

    # What a dialect supplies --------------------------------------------------------------
    @abc.abstractmethod
    def _connection(self) -> Any:
        """The open connection, in autocommit mode (the caller holds ``_db_lock``)."""

    @abc.abstractmethod
    def _atomic(self, conn: Any) -> contextlib.AbstractContextManager:
        """A transaction on ``conn``: committed (durably) when the block exits, rolled back if it raises."""

    @abc.abstractmethod
    def _schema_version(self, tx: Tx) -> int:
        """The database's schema version (0: empty), read in the upgrade's transaction."""

    @abc.abstractmethod
    def _set_schema_version(self, tx: Tx) -> None:
        """Records ``SCHEMA_VERSION`` as the database's, in the upgrade's transaction."""

    # SQL helpers ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Tx]:
        """One atomic commit, durable when the block exits (rolled back if it raises)."""
        with self._db_lock:
            conn = self._connection()
            with self._atomic(conn):
                yield Tx(conn, self.PLACEHOLDER)

    @contextlib.contextmanager
    def _reading(self) -> Iterator[Tx]:
        """Reads outside a transaction (each statement sees what was committed before it)."""
        with self._db_lock:
            yield Tx(self._connection(), self.PLACEHOLDER)

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._reading() as tx:
            return tx.all(sql, params)

    def _init_schema(self) -> None:
        """Creates the tables in an empty database, upgrades older ones; refuses a newer schema."""
        with self._transaction() as tx:
            version = self._schema_version(tx)
            if version > self.SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self._where}store schema version {version} is newer than this clipd "
                    f"understands ({self.SCHEMA_VERSION}); upgrade clipd or use another {self.PLACE}")
            for statements in self.MIGRATIONS[version:]:
                for statement in statements:
                    tx.execute(statement)
            if version < self.SCHEMA_VERSION:
                self._set_schema_version(tx)

    def _key(self, tx: Tx, aggregation_id: str, *, lock: bool = True) -> int:
        """The aggregation's surrogate key (``KeyError`` if there is none), its row locked until the commit.

        The lock (``FOR_UPDATE``) queues the writers of one aggregation across
        processes: checkpoints take their generation numbers one at a time.
        """
        row = tx.one(f"SELECT key FROM aggregations WHERE id = ?{self.FOR_UPDATE if lock else ''}",
                     (aggregation_id,))
        if row is None:
            raise KeyError(aggregation_id)
        return row[0]

    def _epoch(self, tx: Tx, key: int, shard: int) -> int:
        """The shard's epoch (0: unclaimed), its row share-locked until the commit (a claim waits for it)."""
        row = tx.one(f"SELECT epoch FROM shard_epochs WHERE aggregation = ? AND shard = ?{self.FOR_SHARE}",
                     (key, shard))
        return row[0] if row else 0

    def _append_entry(self, tx: Tx, ledger_id: str, entry: LedgerEntry, position: int | None = None):
        """Appends ``entry``: ``KeyError`` if the ledger does not exist, ``LedgerConflict`` unless it
        has ``position`` entries (None: any number).

        The ledger's row is locked first (``FOR_UPDATE``): appends of several
        processes queue there, and under READ COMMITTED the count, taken after
        the lock, sees every entry committed before it.
        """
        if tx.one(f"SELECT 1 FROM ledgers WHERE id = ?{self.FOR_UPDATE}", (ledger_id,)) is None:
            raise KeyError(ledger_id)
        # Entries are numbered 0, 1, ... with none ever removed: the count is the last position plus one, read
        # from the primary key's end (COUNT(*) reads every entry of the ledger: a trainer's grows by one a step).
        (count,) = tx.row("SELECT COALESCE(MAX(position) + 1, 0) FROM ledger_entries WHERE ledger = ?", (ledger_id,))
        if position is not None and count != position:
            raise LedgerConflict(f"ledger {ledger_id!r} has {count} entries, not {position}")
        tx.execute("INSERT INTO ledger_entries (ledger, position, aggregation_id, event, time, epsilon_after,"
                   " next_bound) VALUES (?, ?, ?, ?, ?, ?, ?)", (ledger_id, count, entry.aggregation_id,
                   entry.event, entry.time, entry.epsilon_after, entry.next_bound))

    # Aggregations -------------------------------------------------------------------------
    def create(self, record: AggregationRecord, *,
               ledger_entry: tuple[str, LedgerEntry] | None = None) -> bool:
        """Adds an aggregation (and a ledger entry, same commit); False (nothing changes) if it exists."""
        check_state(record.state)
        with self._transaction() as tx:
            if not self._insert(tx, record):
                return False
            if ledger_entry is not None:
                self._append_entry(tx, *ledger_entry)
            return True

    def records(self) -> list[AggregationRecord]:
        """Every aggregation, oldest first (by ``created``, then by order of creation)."""
        return [AggregationRecord(*row) for row in self._query(f"{_RECORDS} ORDER BY created, key")]

    def get(self, aggregation_id: str) -> AggregationRecord | None:
        rows = self._query(f"{_RECORDS} WHERE id = ?", (aggregation_id,))
        return AggregationRecord(*rows[0]) if rows else None

    def set_state(self, aggregation_id: str, state: str, *, reason: str = "",
                  finished: float | None = None) -> None:
        """Moves an aggregation to ``state`` (``ValueError`` if unknown; ``KeyError`` if the id is)."""
        check_state(state)
        with self._transaction() as tx:
            cursor = tx.execute("UPDATE aggregations SET state = ?, reason = ?, finished = ? WHERE id = ?",
                                (state, reason, finished, aggregation_id))
            if cursor.rowcount != 1:
                raise KeyError(aggregation_id)

    def delete(self, aggregation_id: str) -> None:
        """Forgets an aggregation (no error if it does not exist): its rows in one commit, then what it
        kept outside them. Its ledger entries stay."""
        with self._files_lock:
            with self._transaction() as tx:
                key = self._delete_rows(tx, aggregation_id)
            if key is not None:
                self._deleted(key)

    def _delete_rows(self, tx: Tx, aggregation_id: str) -> int | None:
        """In ``tx``: the aggregation's rows gone; its key (None: it did not exist). What it kept outside them
        goes after the commit (:meth:`_deleted`)."""
        try:
            key = self._key(tx, aggregation_id)
        except KeyError:
            return None
        for table in ("checkpoints", "releases", "shard_epochs"):
            tx.execute(f"DELETE FROM {table} WHERE aggregation = ?", (key,))
        tx.execute("DELETE FROM aggregations WHERE key = ?", (key,))
        return key

    def _insert(self, tx: Tx, record: AggregationRecord) -> bool:
        """In ``tx``: the aggregation's row; False (nothing written) if its id exists."""
        cursor = tx.execute(
            "INSERT INTO aggregations (id, spec, state, created, finished, reason)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
            (record.aggregation_id, record.spec, record.state, record.created, record.finished, record.reason))
        return cursor.rowcount == 1

    def _deleted(self, key: int) -> None:
        """After the commit that deleted an aggregation's rows: what it kept elsewhere goes (nothing here)."""

    # Checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, aggregation_id: str, partial: PartialState, *, shard: int = 0,
                        epoch: int | None = None) -> None:
        """One commit: the aggregation's row locked, the epoch checked, the blob in the shard's new
        generation, its generations beyond the newest two gone."""
        blob = partial.to_bytes()
        with self._transaction() as tx:
            key = self._key(tx, aggregation_id)
            self._add_checkpoint(tx, aggregation_id, key, shard, epoch, None, blob, len(blob), zlib.crc32(blob))

    def _add_checkpoint(self, tx: Tx, aggregation_id: str, key: int, shard: int, epoch: int | None,
                        generation: int | None, payload: Any, nbytes: int, crc: int) -> list:
        """In ``tx``: the epoch checked (``FencedOut``), the row of ``generation`` (None: the next)
        holding ``payload`` (of ``nbytes`` bytes with CRC-32 ``crc``), the shard's older rows dropped
        (returns :meth:`_drop_checkpoints`)."""
        if epoch is not None:
            current = self._epoch(tx, key, shard)
            if current != epoch:
                raise FencedOut(self.FENCED.format(aggregation_id=aggregation_id, shard=shard,
                                                   epoch=epoch, current=current))
        if generation is None:
            (generation,) = tx.row(NEXT_GENERATION, (key,))
        tx.execute("INSERT INTO checkpoints (aggregation, generation, shard, nbytes, crc32,"
                   f" {self.CHECKPOINT_PAYLOAD}) VALUES (?, ?, ?, ?, ?, ?)",
                   (key, generation, shard, nbytes, crc, payload))
        return self._drop_checkpoints(tx, _OLD_GENERATIONS, (key, shard, key, shard, KEEP_GENERATIONS))

    def _drop_checkpoints(self, tx: Tx, where: str, params: tuple) -> list:
        """Deletes the checkpoint rows ``where``; returns what to remove after the commit (nothing here)."""
        tx.execute(f"DELETE FROM checkpoints WHERE {where}", params)
        return []

    def load_checkpoint(self, aggregation_id: str, *, shard: int = 0,
                        newest_only: bool = False) -> PartialState | None:
        """The shard's newest checkpoint that reads back intact (an older one if it is damaged), or None.

        A damaged one is logged and the previous generation tried, unless
        ``newest_only`` (a final result must be the final state: then None).
        """
        with self._files_lock:
            rows = self._query(
                f"SELECT generation, aggregation, nbytes, crc32, {self.CHECKPOINT_PAYLOAD} FROM checkpoints"
                " WHERE aggregation = (SELECT key FROM aggregations WHERE id = ?) AND shard = ?"
                " ORDER BY generation DESC", (aggregation_id, shard))
            for generation, key, nbytes, crc, payload in rows:
                try:
                    return self._read_checkpoint(key, generation, nbytes, crc, payload)
                except self.UNREADABLE as e:
                    if newest_only:
                        self.log.error("store: the newest checkpoint (%d) of aggregation %r is unusable"
                                       " (%s)", generation, aggregation_id, e)
                        return None
                    self.log.warning("store: checkpoint generation %d of aggregation %r is unusable (%s); "
                                     "trying an older one", generation, aggregation_id, e)
            return None

    def _read_checkpoint(self, key: int, generation: int, nbytes: int, crc: int,
                         payload: Any) -> PartialState:
        """A checkpoint row's state, checked against the row's size and CRC-32, then its own checksum."""
        return PartialState.from_bytes(checked(bytes(payload), nbytes, crc, f"generation {generation}"))

    def claim_shard(self, aggregation_id: str, shard: int) -> int:
        """The shard's next epoch, committed: checkpoints of every earlier epoch are refused from now on.

        The epoch's row stays locked until the commit: a concurrent save's
        check (``FOR_SHARE``) is ordered before or after the claim, never beside it.
        """
        with self._transaction() as tx:
            key = self._key(tx, aggregation_id, lock=False)
            tx.execute("INSERT INTO shard_epochs (aggregation, shard, epoch) VALUES (?, ?, 1)"
                       " ON CONFLICT (aggregation, shard) DO UPDATE SET epoch = shard_epochs.epoch + 1",
                       (key, shard))
            return self._epoch(tx, key, shard)

    # Privacy ledgers ----------------------------------------------------------------------
    def ensure_ledger(self, record: LedgerRecord) -> LedgerRecord:
        with self._transaction() as tx:
            tx.execute("INSERT INTO ledgers (id, config, created) VALUES (?, ?, ?)"
                       " ON CONFLICT (id) DO NOTHING", (record.ledger_id, record.config, record.created))
            return LedgerRecord(*tx.row("SELECT id, config, created FROM ledgers WHERE id = ?",
                                        (record.ledger_id,)))

    def create_stream(self, record: StreamRecord) -> bool:
        with self._transaction() as tx:
            cursor = tx.execute("INSERT INTO buffered_streams (id, spec, created, state, reason) VALUES (?, ?, ?, ?, ?)"
                                " ON CONFLICT (id) DO NOTHING", (record.stream_id, record.spec, record.created,
                                                                 record.state, record.reason))
            return cursor.rowcount == 1

    def streams(self) -> list[StreamRecord]:
        return [StreamRecord(*row) for row in self._query(
            "SELECT id, spec, created, state, reason FROM buffered_streams ORDER BY created, id")]

    def set_stream_state(self, stream_id: str, state: str, reason: str = "") -> None:
        with self._transaction() as tx:
            if tx.execute("UPDATE buffered_streams SET state = ?, reason = ? WHERE id = ?",
                          (state, reason, stream_id)).rowcount != 1:
                raise KeyError(stream_id)

    def ledgers(self) -> list[LedgerRecord]:
        return [LedgerRecord(*row) for row in self._query(
            f"SELECT id, config, created FROM ledgers ORDER BY {self.LEDGER_ORDER}")]

    def ledger_entries(self, ledger_id: str, start: int = 0) -> list[LedgerEntry]:
        return [LedgerEntry(*row) for row in self._query(
            "SELECT aggregation_id, event, time, epsilon_after, next_bound FROM ledger_entries"
            " WHERE ledger = ? AND position >= ? ORDER BY position", (ledger_id, start))]

    def commit_release(self, aggregation_id: str, release: bytes, ledger_id: str, entry: LedgerEntry,
                       position: int, finished: float, *, stream: NoiseStream | None = None,
                       participants: Sequence[str] = (), audit: AuditRecord | None = None,
                       record: AggregationRecord | None = None, drop: str = "") -> None:
        """One commit: the release in its row, the entry at ``position``, FINALIZED, raw checkpoints gone,
        the noise stream, the participations and the audit (and the record made, ``drop``'s rows gone)."""
        release = bytes(release)
        dropped = None
        with self._files_lock:
            try:
                with self._transaction() as tx:
                    key = self._made_key(tx, aggregation_id, record)
                    dropped = self._delete_rows(tx, drop) if drop else None
                    self._add_release(tx, key, release, ledger_id, entry, position, finished, stream,
                                      participants, audit)
            except self.UNIQUE_VIOLATION as e:  # another process took the position (belt and braces)
                raise LedgerConflict(f"ledger {ledger_id!r} gained an entry at {position}") from e
            if dropped is not None:
                self._deleted(dropped)

    def _made_key(self, tx: Tx, aggregation_id: str, record: AggregationRecord | None) -> int:
        """In ``tx``: the aggregation's key, its row added first from ``record`` (``KeyError`` if it exists)."""
        if record is not None:
            check_state(record.state)
            if not self._insert(tx, record):
                raise KeyError(f"aggregation {aggregation_id!r} exists")
        return self._key(tx, aggregation_id)

    def _add_release(self, tx: Tx, key: int, release: bytes, ledger_id: str, entry: LedgerEntry,
                     position: int, finished: float, stream: NoiseStream | None = None,
                     participants: Sequence[str] = (), audit: AuditRecord | None = None,
                     inline: bool = True) -> list:
        """In ``tx``: the entry at ``position``, the release's row (its blob in it, or NULL: ``inline`` False, the
        store keeps it elsewhere), FINALIZED, every checkpoint row dropped (returns :meth:`_drop_checkpoints`); the
        ledger's noise stream and audit replaced, the participants recorded."""
        self._append_entry(tx, ledger_id, entry, position)
        if audit is not None:
            state = bytes(audit.state)
            tx.execute(_UPSERT_AUDIT, (ledger_id, len(state), zlib.crc32(state), state, int(audit.closed)))
        if stream is not None:
            state = bytes(stream.state)
            tx.execute("INSERT INTO ledger_streams (ledger, releases, nbytes, crc32, state) VALUES (?, ?, ?, ?, ?)"
                       " ON CONFLICT (ledger) DO UPDATE SET releases = excluded.releases, nbytes = excluded.nbytes,"
                       " crc32 = excluded.crc32, state = excluded.state",
                       (ledger_id, stream.releases, len(state), zlib.crc32(state), state))
        for client in participants:
            tx.execute("INSERT INTO ledger_participations (ledger, client, position) VALUES (?, ?, ?)",
                       (ledger_id, client, position))
        columns = self.RELEASE_COLUMNS
        upsert = (f"INSERT INTO releases (aggregation, {', '.join(columns)}) VALUES (?{', ?' * len(columns)})"
                  " ON CONFLICT (aggregation) DO UPDATE SET "
                  + ", ".join(f"{c} = excluded.{c}" for c in columns))
        values = {"nbytes": len(release), "crc32": zlib.crc32(release), "blob": release if inline else None}
        tx.execute(upsert, (key, *(values[c] for c in columns)))
        tx.execute("UPDATE aggregations SET state = ?, finished = ? WHERE key = ?",
                   (FINALIZED, finished, key))
        return self._drop_checkpoints(tx, "aggregation = ?", (key,))

    def ledger_audit(self, ledger_id: str) -> bytes | None:
        rows = self._query("SELECT nbytes, crc32, state FROM ledger_audits WHERE ledger = ?", (ledger_id,))
        if not rows:
            return None
        nbytes, crc, state = rows[0]
        return checked(bytes(state), nbytes, crc, f"the audit of ledger {ledger_id!r}")

    def save_ledger_audit(self, ledger_id: str, audit: AuditRecord, *, create: bool = False) -> bytes:
        state = bytes(audit.state)
        row = (ledger_id, len(state), zlib.crc32(state), state, int(audit.closed))
        with self._transaction() as tx:
            if create:
                tx.execute("INSERT INTO ledger_audits (ledger, nbytes, crc32, state, closed) VALUES (?, ?, ?, ?, ?)"
                           " ON CONFLICT (ledger) DO NOTHING", row)
            else:
                tx.execute(_UPSERT_AUDIT, row)
            nbytes, crc, stored = tx.row("SELECT nbytes, crc32, state FROM ledger_audits WHERE ledger = ?",
                                         (ledger_id,))
        return checked(bytes(stored), nbytes, crc, f"the audit of ledger {ledger_id!r}")

    def noise_stream(self, ledger_id: str) -> NoiseStream | None:
        rows = self._query("SELECT releases, nbytes, crc32, state FROM ledger_streams WHERE ledger = ?", (ledger_id,))
        if not rows:
            return None
        releases, nbytes, crc, state = rows[0]
        return NoiseStream(releases, checked(bytes(state), nbytes, crc, f"the noise stream of ledger {ledger_id!r}"))

    def participations(self, ledger_id: str, client: str) -> list[int]:
        return [position for (position,) in self._query(
            "SELECT position FROM ledger_participations WHERE ledger = ? AND client = ? ORDER BY position",
            (ledger_id, client))]

    def ledger_participants(self, ledger_id: str) -> dict[str, list[int]]:
        participants: dict[str, list[int]] = {}
        for client, position in self._query(
                "SELECT client, position FROM ledger_participations WHERE ledger = ? ORDER BY position", (ledger_id,)):
            participants.setdefault(client, []).append(position)
        return participants

    def load_release(self, aggregation_id: str) -> bytes | None:
        with self._files_lock:
            rows = self._query(f"SELECT aggregation, {', '.join(self.RELEASE_COLUMNS)} FROM releases"
                               " WHERE aggregation = (SELECT key FROM aggregations WHERE id = ?)",
                               (aggregation_id,))
            return self._read_release(aggregation_id, rows[0][0], rows[0][1:]) if rows else None

    def _read_release(self, aggregation_id: str, key: int, row: tuple) -> bytes:
        """The release of a row ``(*RELEASE_COLUMNS)``, checked against the row's size and CRC-32."""
        nbytes, crc, blob = row
        return checked(bytes(blob), nbytes, crc, f"the release of aggregation {aggregation_id!r}")
