"""The PostgreSQL dialect of :class:`~clipd.server.stores.sql.SQLStore`: everything in one database.

``PostgresStore("postgresql://user@host:port/db")`` (psycopg 3; ``pip install '.[postgres]'``).
Several clipd processes may share one database: every write is one
transaction, and the writers of one aggregation or one ledger queue on its row
lock (``SELECT ... FOR UPDATE``).

Tables (created on open; ``clipd_schema`` holds the schema version)::

    aggregations    id, spec, state, created, finished, reason; ``key`` a surrogate bigint
    checkpoints     (aggregation key, generation) -> shard, PartialState blob (bytea), its size and CRC-32
    shard_epochs    (aggregation key, shard) -> the epoch of the shard's current owner (fencing)
    secrets         name -> value (the submit-token key, the same for every process)
    releases        aggregation key -> release blob (bytea), its size and CRC-32
    ledgers         id, config, created
    ledger_entries  (ledger, position) -> entry; never deleted (privacy spent stays spent)
    ledger_streams  ledger -> its correlated noise stream after its last release (releases, state blob)
    ledger_participations  (ledger, client, position): the releases each client took part in; never deleted

What is kept and checked is :class:`~clipd.server.stores.sql.SQLStore`'s; this
module owns the connection (``synchronous_commit = on``: a commit waits for the
WAL flush, whatever the server's default; one connection, reopened on the next
call if the server dropped it), the schema and its version, and the submit-token key.
"""

from __future__ import annotations

import logging
import secrets

import psycopg
from psycopg import errors as pg_errors

from clipd.server.stores.sql import SQLStore, Tx, audit_tables, buffered_stream_tables, ledger_tables, stream_tables

SCHEMA_VERSION = 5  # clipd_schema.version; no table is an empty database; 1 had no shards, 2 no noise streams, 3 no
# audits, 4 no buffered streams
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
    *ledger_tables(text="text", integer="bigint", real="double precision"),
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


class PostgresStore(SQLStore):
    """Aggregations, checkpoints, releases and ledgers in the PostgreSQL database at ``dsn``.

    Owns the connection, row locks, the schema's version and the submit-token key; the rest is SQLStore's.
    """

    shared = True  # several servers, Ray actors: every shard owner claims an epoch
    log = logging.getLogger(__name__)
    SCHEMA_VERSION = SCHEMA_VERSION
    MIGRATIONS = (_SCHEMA, _SCHEMA_V2, stream_tables(text="text", integer="bigint", blob="bytea"),
                  audit_tables(text="text", integer="bigint", blob="bytea"),
                  buffered_stream_tables(text="text", real="double precision"))
    PLACEHOLDER = "%s"
    FOR_UPDATE, FOR_SHARE = " FOR UPDATE", " FOR SHARE"
    UNIQUE_VIOLATION = (pg_errors.UniqueViolation,)

    def __init__(self, dsn: str, *, connect_timeout: float = 10.0) -> None:
        super().__init__()
        self.dsn = dsn
        self._connect_timeout = connect_timeout
        self._conn: psycopg.Connection | None = self._connect()
        try:
            self._init_schema()
        except BaseException:
            self._conn.close()
            raise

    def _connect(self) -> psycopg.Connection:
        conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=max(1, int(self._connect_timeout)),
                               application_name="clipd")
        conn.execute("SET synchronous_commit = on")
        return conn

    def _connection(self) -> psycopg.Connection:
        """The connection (caller holds ``_db_lock``), reopened if the server dropped it."""
        if self._conn is None:
            raise RuntimeError("the store is closed")
        if self._conn.closed or self._conn.broken:
            self.log.warning("store: the PostgreSQL connection was lost; reconnecting")
            self._conn = self._connect()
        return self._conn

    def _atomic(self, conn: psycopg.Connection):
        return conn.transaction()

    def _schema_version(self, tx: Tx) -> int:
        """0 for an empty database; under an advisory lock: one process at a time creates the tables."""
        tx.execute("SELECT pg_advisory_xact_lock(?)", (_SCHEMA_LOCK,))
        if not tx.row("SELECT to_regclass('clipd_schema') IS NOT NULL")[0]:
            return 0
        version = tx.row("SELECT max(version) FROM clipd_schema")[0] or 0
        if version < 1:
            raise RuntimeError(f"store schema version {version} is unknown to this clipd ({SCHEMA_VERSION})")
        return version

    def _set_schema_version(self, tx: Tx) -> None:
        tx.execute("DELETE FROM clipd_schema")
        tx.execute("INSERT INTO clipd_schema (version) VALUES (?)", (SCHEMA_VERSION,))

    def submit_token_key(self) -> bytes:
        """The key in ``secrets``: the first process to ask makes it, every other reads it."""
        with self._transaction() as tx:
            tx.execute("INSERT INTO secrets (name, value) VALUES ('submit-token-key', ?)"
                       " ON CONFLICT (name) DO NOTHING", (secrets.token_bytes(32),))
            (key,) = tx.row("SELECT value FROM secrets WHERE name = 'submit-token-key'")
        return bytes(key)

    def close(self) -> None:
        """Closes the connection (a second call does nothing)."""
        with self._db_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
