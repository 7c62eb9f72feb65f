"""A :class:`~clipd.server.stores.base.Store` in PostgreSQL: metadata, ledgers and blobs in one database.

``PostgresStore("postgresql://user@host:port/db")`` (psycopg 3; ``pip install clipd[postgres]``).
Several clipd processes may share one database: every write is one
transaction, and the ledger is appended to under a row lock on the ledger.

Tables (created on open; ``clipd_schema`` holds the schema version)::

    aggregations    id, spec, state, created, finished, reason; ``key`` a surrogate bigint
    checkpoints     (aggregation key, generation) -> shard, PartialState blob (bytea), its size and CRC-32
    shard_epochs    (aggregation key, shard) -> the epoch of the shard's current owner (fencing)
    secrets         name -> value (the submit-token key, the same for every process)
    releases        aggregation key -> release blob (bytea), its size and CRC-32
    ledgers         id, config, created
    ledger_entries  (ledger, position) -> entry; never deleted (privacy spent stays spent)

Semantics are those of :class:`~clipd.server.stores.sqlite.SQLiteStore`:

- Durable on return: every write is a committed transaction, and the session
  sets ``synchronous_commit = on`` (the commit waits for the WAL flush,
  whatever the server's default is).
- The two newest checkpoint generations of each shard are kept; the row
  of a new one and the removal of the older ones (and, with ``finished``, the
  FINALIZED state) are one transaction.
- Reading a checkpoint checks its size and CRC-32 against its row, then the
  blob's own checksum; a damaged newest generation falls back to the previous
  one (with a warning), except with ``newest_only``.
- ``commit_release``: one transaction stores the release, appends the ledger
  entry (``LedgerConflict`` and a rollback if the entry count is not
  ``position``), marks the aggregation FINALIZED and deletes its checkpoints.

One connection, guarded by a lock (every method is thread-safe); it is
reopened on the next call if the server dropped it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import zlib
from collections.abc import Iterator

import psycopg
from psycopg import errors as pg_errors

from clipd.engine import CorruptStateError, PartialState
from clipd.server.stores.base import (
    FINALIZED,
    AggregationRecord,
    FencedOut,
    LedgerConflict,
    LedgerEntry,
    LedgerRecord,
    Store,
    check_state,
    newest_intact,
)

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # clipd_schema.version; no table is an empty database; 1 had no shards
KEEP_GENERATIONS = 2  # checkpoints kept per shard: the newest and the one before
_SCHEMA_LOCK = 0x636C6970  # pg_advisory_xact_lock key: one process creates the schema at a time

_SCHEMA = (
    "CREATE TABLE clipd_schema (version integer NOT NULL)",
    """CREATE TABLE aggregations (
        key bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- order of creation; never reused
        id text NOT NULL UNIQUE,
        spec text NOT NULL,
        state text NOT NULL,
        created double precision NOT NULL,
        finished double precision,
        reason text NOT NULL DEFAULT ''
    )""",
    """CREATE TABLE checkpoints (
        aggregation bigint NOT NULL REFERENCES aggregations (key) ON DELETE CASCADE,
        generation bigint NOT NULL,
        nbytes bigint NOT NULL,
        crc32 bigint NOT NULL,  -- of the whole blob
        blob bytea NOT NULL,
        PRIMARY KEY (aggregation, generation)
    )""",
    """CREATE TABLE releases (
        aggregation bigint PRIMARY KEY REFERENCES aggregations (key) ON DELETE CASCADE,
        nbytes bigint NOT NULL,
        crc32 bigint NOT NULL,
        blob bytea NOT NULL
    )""",
    """CREATE TABLE ledgers (
        id text PRIMARY KEY,
        config text NOT NULL,
        created double precision NOT NULL
    )""",
    """CREATE TABLE ledger_entries (  -- never deleted: privacy spent stays spent
        ledger text NOT NULL REFERENCES ledgers (id),
        position bigint NOT NULL,
        aggregation_id text NOT NULL,  -- not a reference: the aggregation may be deleted
        event text NOT NULL,
        time double precision NOT NULL,
        epsilon_after double precision NOT NULL,
        next_bound double precision,
        PRIMARY KEY (ledger, position)
    )""",
)

_SCHEMA_V2 = (
    "ALTER TABLE checkpoints ADD COLUMN shard integer NOT NULL DEFAULT 0",
    """CREATE TABLE shard_epochs (
        aggregation bigint NOT NULL REFERENCES aggregations (key) ON DELETE CASCADE,
        shard integer NOT NULL,
        epoch bigint NOT NULL,
        PRIMARY KEY (aggregation, shard)
    )""",
    "CREATE TABLE secrets (name text PRIMARY KEY, value bytea NOT NULL)",
)

_RECORD_COLUMNS = "id, spec, state, created, finished, reason"


class PostgresStore(Store):
    """Aggregations, checkpoints, releases and ledgers in the PostgreSQL database at ``dsn``."""

    durable = True
    shared = True  # several servers, Ray actors: every shard owner claims an epoch

    def __init__(self, dsn: str, *, connect_timeout: float = 10.0) -> None:
        self.dsn = dsn
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        with self._lock:
            self._conn = self._connect()
            try:
                self._init_schema()
            except BaseException:
                self._conn.close()
                raise

    # Connection ---------------------------------------------------------------------------
    def _connect(self) -> psycopg.Connection:
        conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=max(1, int(self._connect_timeout)),
                               application_name="clipd")
        conn.execute("SET synchronous_commit = on")
        return conn

    def _connection(self) -> psycopg.Connection:
        """The connection (caller holds ``_lock``), reopened if the server dropped it."""
        if self._conn is None:
            raise RuntimeError("the store is closed")
        if self._conn.closed or self._conn.broken:
            log.warning("store: the PostgreSQL connection was lost; reconnecting")
            self._conn = self._connect()
        return self._conn

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection]:
        """One transaction, committed (durably) when the block exits, rolled back if it raises."""
        with self._lock:
            conn = self._connection()
            with conn.transaction():
                yield conn

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._connection().execute(sql, params).fetchall()

    def _init_schema(self) -> None:
        """Creates the tables in an empty database; refuses a schema newer than this code knows."""
        conn = self._conn
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            exists = conn.execute("SELECT to_regclass('clipd_schema') IS NOT NULL").fetchone()[0]
            if not exists:
                for statement in _SCHEMA:
                    conn.execute(statement)
                version = 1
            else:
                row = conn.execute("SELECT max(version) FROM clipd_schema").fetchone()
                version = row[0] if row and row[0] is not None else 0
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"store schema version {version} is newer than this clipd understands "
                    f"({SCHEMA_VERSION}); upgrade clipd or use another database")
            if version < 1:
                raise RuntimeError(f"store schema version {version} is unknown to this clipd ({SCHEMA_VERSION})")
            if version < 2:
                for statement in _SCHEMA_V2:
                    conn.execute(statement)
            if version < SCHEMA_VERSION or not exists:
                conn.execute("DELETE FROM clipd_schema")
                conn.execute("INSERT INTO clipd_schema (version) VALUES (%s)", (SCHEMA_VERSION,))

    # Aggregations -------------------------------------------------------------------------
    def create(self, record: AggregationRecord, *, ledger_entry: tuple[str, LedgerEntry] | None = None) -> bool:
        check_state(record.state)
        with self._transaction() as conn:
            cursor = conn.execute(
                "INSERT INTO aggregations (id, spec, state, created, finished, reason)"
                " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
                (record.aggregation_id, record.spec, record.state, record.created, record.finished,
                 record.reason))
            if cursor.rowcount != 1:
                return False
            if ledger_entry is not None:
                ledger_id, entry = ledger_entry
                position = _lock_ledger(conn, ledger_id)
                _insert_entry(conn, ledger_id, position, entry)
            return True

    def records(self) -> list[AggregationRecord]:
        """Every aggregation, oldest first (by ``created``, then by order of creation)."""
        return [AggregationRecord(*row) for row in self._query(
            f"SELECT {_RECORD_COLUMNS} FROM aggregations ORDER BY created, key")]

    def get(self, aggregation_id: str) -> AggregationRecord | None:
        rows = self._query(f"SELECT {_RECORD_COLUMNS} FROM aggregations WHERE id = %s", (aggregation_id,))
        return AggregationRecord(*rows[0]) if rows else None

    def set_state(self, aggregation_id: str, state: str, *, reason: str = "",
                  finished: float | None = None) -> None:
        check_state(state)
        with self._transaction() as conn:
            cursor = conn.execute("UPDATE aggregations SET state = %s, reason = %s, finished = %s WHERE id = %s",
                                  (state, reason, finished, aggregation_id))
            if cursor.rowcount != 1:
                raise KeyError(aggregation_id)

    def delete(self, aggregation_id: str) -> None:
        """Forgets an aggregation, its checkpoints and its release (cascade); its ledger entries stay."""
        with self._transaction() as conn:
            conn.execute("DELETE FROM aggregations WHERE id = %s", (aggregation_id,))

    # Checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, aggregation_id: str, partial: PartialState, *, shard: int = 0,
                        epoch: int | None = None, finished: float | None = None) -> None:
        """One commit: the epoch checked, the shard's new generation, its older ones beyond two gone,
        FINALIZED with ``finished``."""
        blob = partial.to_bytes()
        with self._transaction() as conn:
            key = _lock_aggregation(conn, aggregation_id)
            if epoch is not None:
                current = _epoch(conn, key, shard)
                if current != epoch:
                    raise FencedOut(f"aggregation {aggregation_id!r} shard {shard}: epoch {epoch} was"
                                    f" replaced by {current}")
            (generation,) = conn.execute(
                "SELECT COALESCE(max(generation), 0) + 1 FROM checkpoints WHERE aggregation = %s",
                (key,)).fetchone()
            conn.execute("INSERT INTO checkpoints (aggregation, generation, shard, nbytes, crc32, blob)"
                         " VALUES (%s, %s, %s, %s, %s, %s)",
                         (key, generation, shard, len(blob), zlib.crc32(blob), blob))
            conn.execute("DELETE FROM checkpoints WHERE aggregation = %s AND shard = %s AND generation IN"
                         " (SELECT generation FROM checkpoints WHERE aggregation = %s AND shard = %s"
                         "  ORDER BY generation DESC OFFSET %s)", (key, shard, key, shard, KEEP_GENERATIONS))
            if finished is not None:
                conn.execute("UPDATE aggregations SET state = %s, finished = %s WHERE key = %s",
                             (FINALIZED, finished, key))

    def load_checkpoint(self, aggregation_id: str, *, shard: int = 0,
                        newest_only: bool = False) -> PartialState | None:
        """The shard's newest checkpoint that reads back intact (an older one if it is damaged), or None."""
        rows = self._query(
            "SELECT c.generation, c.nbytes, c.crc32, c.blob FROM checkpoints c"
            " JOIN aggregations a ON a.key = c.aggregation WHERE a.id = %s AND c.shard = %s"
            " ORDER BY c.generation DESC", (aggregation_id, shard))
        return newest_intact(aggregation_id, [(g, g, n, c, b) for g, n, c, b in rows],
                             lambda generation, nbytes, crc, blob: PartialState.from_bytes(
                                 _checked(bytes(blob), nbytes, crc, f"generation {generation}")),
                             newest_only, log)

    def claim_shard(self, aggregation_id: str, shard: int) -> int:
        """The shard's next epoch, committed; the row lock orders it against every concurrent save."""
        with self._transaction() as conn:
            row = conn.execute("SELECT key FROM aggregations WHERE id = %s", (aggregation_id,)).fetchone()
            if row is None:
                raise KeyError(aggregation_id)
            (epoch,) = conn.execute(
                "INSERT INTO shard_epochs (aggregation, shard, epoch) VALUES (%s, %s, 1)"
                " ON CONFLICT (aggregation, shard) DO UPDATE SET epoch = shard_epochs.epoch + 1"
                " RETURNING epoch", (row[0], shard)).fetchone()
            return epoch

    def submit_token_key(self) -> bytes:
        """The key in ``secrets``: the first process to ask makes it, every other reads it."""
        with self._transaction() as conn:
            conn.execute("INSERT INTO secrets (name, value) VALUES ('submit-token-key', %s)"
                         " ON CONFLICT (name) DO NOTHING", (secrets.token_bytes(32),))
            (key,) = conn.execute("SELECT value FROM secrets WHERE name = 'submit-token-key'").fetchone()
        return bytes(key)

    # Privacy ledgers ----------------------------------------------------------------------
    def ensure_ledger(self, record: LedgerRecord) -> LedgerRecord:
        with self._transaction() as conn:
            conn.execute("INSERT INTO ledgers (id, config, created) VALUES (%s, %s, %s) ON CONFLICT (id) DO NOTHING",
                         (record.ledger_id, record.config, record.created))
            row = conn.execute("SELECT id, config, created FROM ledgers WHERE id = %s",
                               (record.ledger_id,)).fetchone()
        return LedgerRecord(*row)

    def ledgers(self) -> list[LedgerRecord]:
        return [LedgerRecord(*row) for row in self._query(
            "SELECT id, config, created FROM ledgers ORDER BY created, id")]

    def ledger_entries(self, ledger_id: str, start: int = 0) -> list[LedgerEntry]:
        return [LedgerEntry(*row) for row in self._query(
            "SELECT aggregation_id, event, time, epsilon_after, next_bound FROM ledger_entries"
            " WHERE ledger = %s AND position >= %s ORDER BY position", (ledger_id, start))]

    def commit_release(self, aggregation_id: str, release: bytes, ledger_id: str, entry: LedgerEntry,
                       position: int, finished: float) -> None:
        """One commit: the release, the entry at ``position``, FINALIZED, the raw checkpoints gone."""
        release = bytes(release)
        try:
            with self._transaction() as conn:
                key = _lock_aggregation(conn, aggregation_id)
                count = _lock_ledger(conn, ledger_id)
                if count != position:
                    raise LedgerConflict(f"ledger {ledger_id!r} has {count} entries, not {position}")
                _insert_entry(conn, ledger_id, position, entry)
                conn.execute(
                    "INSERT INTO releases (aggregation, nbytes, crc32, blob) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (aggregation) DO UPDATE"
                    " SET nbytes = EXCLUDED.nbytes, crc32 = EXCLUDED.crc32, blob = EXCLUDED.blob",
                    (key, len(release), zlib.crc32(release), release))
                conn.execute("UPDATE aggregations SET state = %s, finished = %s WHERE key = %s",
                             (FINALIZED, finished, key))
                conn.execute("DELETE FROM checkpoints WHERE aggregation = %s", (key,))
        except pg_errors.UniqueViolation as e:  # another process took the position (belt and braces)
            raise LedgerConflict(f"ledger {ledger_id!r} gained an entry at {position}") from e

    def load_release(self, aggregation_id: str) -> bytes | None:
        rows = self._query("SELECT r.nbytes, r.crc32, r.blob FROM releases r"
                           " JOIN aggregations a ON a.key = r.aggregation WHERE a.id = %s", (aggregation_id,))
        if not rows:
            return None
        nbytes, crc, blob = rows[0]
        return _checked(bytes(blob), nbytes, crc, f"the release of aggregation {aggregation_id!r}")

    def close(self) -> None:
        """Closes the connection (a second call does nothing)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


# Helpers ----------------------------------------------------------------------------------
def _lock_aggregation(conn: psycopg.Connection, aggregation_id: str) -> int:
    """The aggregation's key, its row locked until the transaction ends; ``KeyError`` if absent."""
    row = conn.execute("SELECT key FROM aggregations WHERE id = %s FOR UPDATE", (aggregation_id,)).fetchone()
    if row is None:
        raise KeyError(aggregation_id)
    return row[0]


def _lock_ledger(conn: psycopg.Connection, ledger_id: str) -> int:
    """The ledger's entry count, its row locked until the transaction ends; ``KeyError`` if absent.

    The lock serializes appends across processes; under READ COMMITTED the
    count, taken after the lock, sees every entry committed before it.
    """
    if conn.execute("SELECT 1 FROM ledgers WHERE id = %s FOR UPDATE", (ledger_id,)).fetchone() is None:
        raise KeyError(ledger_id)
    (count,) = conn.execute("SELECT count(*) FROM ledger_entries WHERE ledger = %s", (ledger_id,)).fetchone()
    return count


def _epoch(conn: psycopg.Connection, key: int, shard: int) -> int:
    """The shard's epoch, its row share-locked until the transaction ends (a claim waits for it)."""
    row = conn.execute("SELECT epoch FROM shard_epochs WHERE aggregation = %s AND shard = %s FOR SHARE",
                       (key, shard)).fetchone()
    return row[0] if row else 0


def _insert_entry(conn: psycopg.Connection, ledger_id: str, position: int, entry: LedgerEntry) -> None:
    conn.execute("INSERT INTO ledger_entries (ledger, position, aggregation_id, event, time, epsilon_after,"
                 " next_bound) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                 (ledger_id, position, entry.aggregation_id, entry.event, entry.time, entry.epsilon_after,
                  entry.next_bound))


def _checked(blob: bytes, nbytes: int, crc: int, what: str) -> bytes:
    """``blob`` if its size and CRC-32 match its row; ``CorruptStateError`` otherwise."""
    if len(blob) != nbytes:
        raise CorruptStateError(f"{what}: {len(blob)} bytes, the row says {nbytes}")
    if zlib.crc32(blob) != crc:
        raise CorruptStateError(f"{what}: CRC-32 differs from the row's")
    return blob

