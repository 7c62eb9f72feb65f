"""The crash-safe one-machine :class:`~clipd.server.stores.base.Store`: SQLite metadata, one file per checkpoint.

Layout of ``data_dir``::

    clipd.sqlite3               aggregations and checkpoint rows (WAL, synchronous=FULL)
    states/<key>/<gen>.state    one PartialState blob per checkpoint generation (of some shard)
    states/<key>/<shard>-<hex>.state  the same, written by a shard process (``--processes``)
    states/<key>/release        a private release (noised sums), once committed

``<key>`` is the aggregation's surrogate integer key, never its id (ids may be
``"."`` or ``".."``). Generations count up per aggregation, over all its shards;
the two newest generations of each shard are kept.

Why a crash at any point loses nothing that was acknowledged and never mixes
two states (Pillai et al., OSDI'14: a rename alone is not durable):

1. The blob goes to ``<name>.state.tmp``, is fsynced, renamed to ``<name>.state``
   and the directory is fsynced: from then on the file's name and content are
   on disk. A crash before that leaves a ``.tmp`` or a file with no row.
2. Only then does one SQLite transaction add the checkpoint's row (size and
   CRC-32 of the blob) and, with ``finished``, mark the aggregation FINALIZED.
   ``save_checkpoint`` returns after that commit: the checkpoint is durable.
3. Rows older than the previous generation go in the same transaction; their
   files are unlinked after it. A crash in between leaves files with no row.

A private release follows the same two steps: the ``release`` file is made
durable, then one transaction adds its row, appends the ledger entry and
marks the aggregation FINALIZED; its raw checkpoints' rows go in that same
transaction and their files after it (only noised sums are kept).

Opening the store removes what steps 1 and 3 can leave behind (``.tmp`` files,
files with no row). Reading a checkpoint checks its size and CRC against its
row and the blob's own checksum; if the newest is damaged, the previous
generation is used (and a warning logged), so a checkpoint is never half-read.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator

from clipd.engine import CorruptStateError, PartialState
from clipd.server.credentials import load_key
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

SCHEMA_VERSION = 3  # PRAGMA user_version; 0 is an empty database; 1 had no ledgers; 2 no shards
KEEP_GENERATIONS = 2  # checkpoint files kept per shard: the newest and the one before
DB_NAME = "clipd.sqlite3"
RELEASE_FILE = "release"
STATES_DIR = "states"

_SCHEMA = (
    """CREATE TABLE aggregations (
        key INTEGER PRIMARY KEY AUTOINCREMENT,  -- names the state directory; never reused
        id TEXT NOT NULL UNIQUE,
        spec TEXT NOT NULL,
        state TEXT NOT NULL,
        created REAL NOT NULL,
        finished REAL,
        reason TEXT NOT NULL DEFAULT ''
    )""",
    """CREATE TABLE checkpoints (
        aggregation INTEGER NOT NULL REFERENCES aggregations (key),
        generation INTEGER NOT NULL,
        file TEXT NOT NULL,  -- name inside states/<key>/
        nbytes INTEGER NOT NULL,
        crc32 INTEGER NOT NULL,  -- of the whole blob
        PRIMARY KEY (aggregation, generation)
    )""",
)
_SCHEMA_V2 = (
    """CREATE TABLE ledgers (
        id TEXT PRIMARY KEY,
        config TEXT NOT NULL,
        created REAL NOT NULL
    )""",
    """CREATE TABLE ledger_entries (  -- never deleted: privacy spent stays spent
        ledger TEXT NOT NULL REFERENCES ledgers (id),
        position INTEGER NOT NULL,
        aggregation_id TEXT NOT NULL,  -- not a reference: the aggregation may be deleted
        event TEXT NOT NULL,
        time REAL NOT NULL,
        epsilon_after REAL NOT NULL,
        next_bound REAL,
        PRIMARY KEY (ledger, position)
    )""",
    """CREATE TABLE releases (
        aggregation INTEGER PRIMARY KEY REFERENCES aggregations (key),
        nbytes INTEGER NOT NULL,
        crc32 INTEGER NOT NULL
    )""",
)

_SCHEMA_V3 = (
    "ALTER TABLE checkpoints ADD COLUMN shard INTEGER NOT NULL DEFAULT 0",
    """CREATE TABLE shard_epochs (  -- the epoch of each shard's current owner (fencing)
        aggregation INTEGER NOT NULL REFERENCES aggregations (key),
        shard INTEGER NOT NULL,
        epoch INTEGER NOT NULL,
        PRIMARY KEY (aggregation, shard)
    )""",
)

_KEY_DIR = re.compile(r"[1-9][0-9]*")


class SQLiteStore(Store):
    """Aggregations and their checkpoints in ``data_dir``, durable on return of every write.

    Two locks: ``_db_lock`` guards the SQLite connection and is held only for
    SQL; ``_files_lock`` serializes the methods that touch checkpoint files
    (save, load, delete), so a slow checkpoint write never holds up ``create``,
    ``get``, ``records`` or ``set_state``. Lock order: files, then db.
    """

    durable = True

    def __init__(self, data_dir: str, *, sibling: bool = False) -> None:
        """``sibling``: a shard process of the clipd that holds ``data_dir`` (``clipd serve --processes N``).

        It takes no lock on the directory and sweeps nothing (its owner did both
        when it opened the store, and other processes' files may be in flight);
        several processes then commit to one database, each to its own shards.
        """
        self.data_dir = os.fspath(data_dir)
        self._sibling = sibling
        self._states = os.path.join(self.data_dir, STATES_DIR)
        self._db_lock = threading.Lock()
        self._files_lock = threading.Lock()
        _make_dir(self.data_dir)
        _make_dir(self._states)
        self._lock_file = None if sibling else _lock_exclusively(os.path.join(self.data_dir, "lock"))
        # Shard processes hold the sweep lock shared while they run; the owner sweeps only under it
        # exclusively, so it never removes a file that a shard process of an earlier owner still commits.
        self._sweep_lock = open(os.path.join(self.data_dir, "sweep.lock"), "a+b")
        self._conn = self._connect(os.path.join(self.data_dir, DB_NAME))
        try:
            if sibling:
                fcntl.flock(self._sweep_lock.fileno(), fcntl.LOCK_SH)
            else:
                self._init_schema()
                _fsync_dir(self.data_dir)  # the database and its WAL are entries of data_dir
                if _wait_for_lock(self._sweep_lock, SWEEP_WAIT):
                    try:
                        self._sweep()
                    finally:
                        fcntl.flock(self._sweep_lock.fileno(), fcntl.LOCK_UN)
                else:
                    log.warning("store: shard processes of an earlier clipd still run in %s; not sweeping"
                                " (what a crash left goes at the next open)", self.data_dir)
        except BaseException:
            self._conn.close()
            self._sweep_lock.close()
            if self._lock_file is not None:
                self._lock_file.close()
            raise

    # Opening ------------------------------------------------------------------------------
    @staticmethod
    def _connect(path: str) -> sqlite3.Connection:
        """One connection in autocommit mode: transactions are the explicit ``BEGIN IMMEDIATE`` ones."""
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            log.warning("SQLite refused WAL mode for %s (journal mode is %s)", path, mode)
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA busy_timeout=60000")  # shard processes share the database: wait for its lock
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    def _init_schema(self) -> None:
        """Creates the tables in an empty database; refuses a schema newer than this code knows."""
        with self._transaction() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.data_dir}: store schema version {version} is newer than this clipd "
                    f"understands ({SCHEMA_VERSION}); upgrade clipd or use another data dir")
            if version == 0:
                for statement in _SCHEMA:
                    conn.execute(statement)
            if version < 2:
                for statement in _SCHEMA_V2:
                    conn.execute(statement)
            if version < 3:
                for statement in _SCHEMA_V3:
                    conn.execute(statement)
            if version < SCHEMA_VERSION:
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _sweep(self) -> None:
        """Removes what a crash leaves under ``states/``: ``*.tmp`` files and files with no checkpoint row."""
        rows = {(key, name) for key, name in self._query("SELECT aggregation, file FROM checkpoints")}
        rows |= {(key, RELEASE_FILE) for (key,) in self._query("SELECT aggregation FROM releases")}
        keys = {key for (key,) in self._query("SELECT key FROM aggregations")}
        removed_dirs = False
        for entry in os.scandir(self._states):
            if not (entry.is_dir(follow_symlinks=False) and _KEY_DIR.fullmatch(entry.name)):
                continue  # not ours: leave it alone
            key = int(entry.name)
            stray = [f.name for f in os.scandir(entry.path) if f.is_file(follow_symlinks=False) and (
                f.name.endswith(".tmp") or ((f.name.endswith(".state") or f.name == RELEASE_FILE)
                                            and (key, f.name) not in rows))]
            for name in stray:
                log.info("store: removing %s/%s left by an interrupted checkpoint", entry.path, name)
            _remove_files(entry.path, stray)
            if key not in keys:
                with contextlib.suppress(OSError):  # not empty: files that are not ours
                    os.rmdir(entry.path)
                    removed_dirs = True
        if removed_dirs:
            _fsync_dir(self._states)

    # SQL helpers --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic commit, durable when the block exits (rolled back if it raises)."""
        with self._db_lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._db_lock:
            return self._conn.execute(sql, params).fetchall()

    def _key(self, aggregation_id: str) -> int | None:
        rows = self._query("SELECT key FROM aggregations WHERE id = ?", (aggregation_id,))
        return rows[0][0] if rows else None

    def _state_dir(self, key: int) -> str:
        return os.path.join(self._states, str(key))

    # Aggregations -------------------------------------------------------------------------
    def create(self, record: AggregationRecord, *, ledger_entry: tuple[str, LedgerEntry] | None = None) -> bool:
        """Adds an aggregation (and a ledger entry, same commit); False (nothing changes) if its id exists."""
        check_state(record.state)
        with self._transaction() as conn:
            cursor = conn.execute(
                "INSERT INTO aggregations (id, spec, state, created, finished, reason) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (id) DO NOTHING",
                (record.aggregation_id, record.spec, record.state, record.created, record.finished,
                 record.reason))
            if cursor.rowcount != 1:
                return False
            if ledger_entry is not None:
                ledger_id, entry = ledger_entry
                if not conn.execute("SELECT 1 FROM ledgers WHERE id = ?", (ledger_id,)).fetchall():
                    raise KeyError(ledger_id)
                (position,) = conn.execute("SELECT COUNT(*) FROM ledger_entries WHERE ledger = ?",
                                           (ledger_id,)).fetchone()
                _insert_entry(conn, ledger_id, position, entry)
            return True

    def records(self) -> list[AggregationRecord]:
        """Every aggregation, oldest first (by ``created``, then by order of creation)."""
        return [_record(row) for row in self._query(
            "SELECT id, spec, state, created, finished, reason FROM aggregations ORDER BY created, key")]

    def get(self, aggregation_id: str) -> AggregationRecord | None:
        rows = self._query("SELECT id, spec, state, created, finished, reason FROM aggregations WHERE id = ?",
                           (aggregation_id,))
        return _record(rows[0]) if rows else None

    def set_state(self, aggregation_id: str, state: str, *, reason: str = "",
                  finished: float | None = None) -> None:
        """Moves an aggregation to ``state`` (``ValueError`` if unknown; ``KeyError`` if the id is)."""
        check_state(state)
        with self._transaction() as conn:
            cursor = conn.execute("UPDATE aggregations SET state = ?, reason = ?, finished = ? WHERE id = ?",
                                  (state, reason, finished, aggregation_id))
            if cursor.rowcount != 1:
                raise KeyError(aggregation_id)

    def delete(self, aggregation_id: str) -> None:
        """Forgets an aggregation: its rows in one commit, then its files (no error if it does not exist)."""
        with self._files_lock:
            key = self._key(aggregation_id)
            if key is None:
                return
            with self._transaction() as conn:
                conn.execute("DELETE FROM checkpoints WHERE aggregation = ?", (key,))
                conn.execute("DELETE FROM releases WHERE aggregation = ?", (key,))
                conn.execute("DELETE FROM shard_epochs WHERE aggregation = ?", (key,))
                conn.execute("DELETE FROM aggregations WHERE key = ?", (key,))
            self._remove_state_dir(key)

    def _remove_state_dir(self, key: int) -> None:
        """Best effort: what is left (an error, a crash) has no row and goes at the next open."""
        directory = self._state_dir(key)
        try:
            _remove_files(directory, os.listdir(directory))
            os.rmdir(directory)
            _fsync_dir(self._states)
        except FileNotFoundError:
            pass  # never checkpointed
        except OSError as e:
            log.warning("store: could not remove %s (%s); it goes at the next open", directory, e)

    # Checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, aggregation_id: str, partial: PartialState, *, shard: int = 0,
                        epoch: int | None = None, finished: float | None = None) -> None:
        """Commits ``partial`` as the shard's newest checkpoint: file durable first, then its row (module doc).

        With ``finished``, the same SQLite commit marks the aggregation FINALIZED.
        ``KeyError`` (and nothing written) if the aggregation does not exist;
        ``FencedOut`` (nothing kept) if ``epoch`` is not the shard's current one.
        """
        blob = partial.to_bytes()
        with self._files_lock:
            key = self._key(aggregation_id)
            if key is None:
                raise KeyError(aggregation_id)
            directory = self._state_dir(key)
            if not os.path.isdir(directory):
                _make_dir(directory)
            if self._sibling:  # processes commit to one database at once: the generation is taken in the commit
                generation, name = None, f"{shard}-{secrets.token_hex(8)}.state"
            else:
                generation = self._query("SELECT COALESCE(MAX(generation), 0) + 1 FROM checkpoints"
                                         " WHERE aggregation = ?", (key,))[0][0]
                name = f"{generation}.state"
            _write_durably(directory, name, blob)
            # If the commit fails, the file stays: it has no row (swept at the next open), and deleting it
            # would be wrong if the commit did reach the disk before the error.
            try:
                pruned = self._commit_checkpoint(key, shard, epoch, generation, name, blob, finished)
            except FencedOut:
                _remove_files(directory, [name])  # refused before the commit: no row points at it
                raise
            if pruned:
                _remove_files(directory, pruned)
                _fsync_dir(directory)

    def _commit_checkpoint(self, key: int, shard: int, epoch: int | None, generation: int | None, name: str,
                           blob: bytes, finished: float | None) -> list[str]:
        """One transaction: the epoch checked, the new row, FINALIZED if ``finished``, the shard's old rows dropped.

        Returns the dropped rows' files.
        """
        with self._transaction() as conn:
            if epoch is not None:
                current = _epoch(conn, key, shard)
                if current != epoch:
                    raise FencedOut(f"shard {shard}: epoch {epoch} was replaced by {current}")
            if generation is None:
                generation = conn.execute("SELECT COALESCE(MAX(generation), 0) + 1 FROM checkpoints"
                                          " WHERE aggregation = ?", (key,)).fetchone()[0]
            conn.execute("INSERT INTO checkpoints (aggregation, generation, file, nbytes, crc32, shard)"
                         " VALUES (?, ?, ?, ?, ?, ?)", (key, generation, name, len(blob), zlib.crc32(blob), shard))
            if finished is not None:
                conn.execute("UPDATE aggregations SET state = ?, finished = ? WHERE key = ?",
                             (FINALIZED, finished, key))
            old = conn.execute("SELECT generation, file FROM checkpoints WHERE aggregation = ? AND shard = ?"
                               " ORDER BY generation DESC LIMIT -1 OFFSET ?",
                               (key, shard, KEEP_GENERATIONS)).fetchall()
            conn.executemany("DELETE FROM checkpoints WHERE aggregation = ? AND generation = ?",
                             [(key, g) for g, _ in old])
        return [name for _, name in old]

    def load_checkpoint(self, aggregation_id: str, *, shard: int = 0,
                        newest_only: bool = False) -> PartialState | None:
        """The shard's newest checkpoint that reads back intact (an older one if it is damaged), or None."""
        with self._files_lock:
            key = self._key(aggregation_id)
            if key is None:
                return None
            rows = self._query("SELECT generation, file, nbytes, crc32 FROM checkpoints"
                               " WHERE aggregation = ? AND shard = ? ORDER BY generation DESC", (key, shard))
            return newest_intact(aggregation_id, rows,
                                 lambda name, nbytes, crc: self._read_checkpoint(key, name, nbytes, crc),
                                 newest_only, log, errors=(OSError, CorruptStateError))

    def claim_shard(self, aggregation_id: str, shard: int) -> int:
        """The shard's next epoch, committed: checkpoints of every earlier epoch are refused from now on."""
        with self._transaction() as conn:
            row = conn.execute("SELECT key FROM aggregations WHERE id = ?", (aggregation_id,)).fetchone()
            if row is None:
                raise KeyError(aggregation_id)
            epoch = _epoch(conn, row[0], shard) + 1
            conn.execute("INSERT OR REPLACE INTO shard_epochs (aggregation, shard, epoch) VALUES (?, ?, ?)",
                         (row[0], shard, epoch))
            return epoch

    def submit_token_key(self) -> bytes:
        """``<data_dir>/submit-token.key`` (0600), made on first use."""
        return load_key(self.data_dir)

    def _read_checkpoint(self, key: int, name: str, nbytes: int, crc: int) -> PartialState:
        """The blob of one checkpoint row, checked against the row and its own checksum."""
        with open(os.path.join(self._state_dir(key), name), "rb") as f:
            blob = f.read()
        if len(blob) != nbytes:
            raise CorruptStateError(f"{name}: {len(blob)} bytes, the row says {nbytes}")
        if zlib.crc32(blob) != crc:
            raise CorruptStateError(f"{name}: CRC-32 differs from the row's")
        return PartialState.from_bytes(blob)

    # Privacy ledgers ----------------------------------------------------------------------
    def ensure_ledger(self, record: LedgerRecord) -> LedgerRecord:
        with self._transaction() as conn:
            conn.execute("INSERT INTO ledgers (id, config, created) VALUES (?, ?, ?) ON CONFLICT (id) DO NOTHING",
                         (record.ledger_id, record.config, record.created))
            row = conn.execute("SELECT id, config, created FROM ledgers WHERE id = ?", (record.ledger_id,)).fetchone()
        return LedgerRecord(*row)

    def ledgers(self) -> list[LedgerRecord]:
        return [LedgerRecord(*row) for row in self._query("SELECT id, config, created FROM ledgers ORDER BY created")]

    def ledger_entries(self, ledger_id: str, start: int = 0) -> list[LedgerEntry]:
        return [LedgerEntry(*row) for row in self._query(
            "SELECT aggregation_id, event, time, epsilon_after, next_bound FROM ledger_entries"
            " WHERE ledger = ? AND position >= ? ORDER BY position", (ledger_id, start))]

    def commit_release(self, aggregation_id: str, release: bytes, ledger_id: str, entry: LedgerEntry,
                       position: int, finished: float) -> None:
        """The release file durable first, then one commit: its row, the entry, FINALIZED, raw rows gone."""
        with self._files_lock:
            key = self._key(aggregation_id)
            if key is None:
                raise KeyError(aggregation_id)
            directory = self._state_dir(key)
            if not os.path.isdir(directory):
                _make_dir(directory)
            _write_durably(directory, RELEASE_FILE, release)
            with self._transaction() as conn:
                if not conn.execute("SELECT 1 FROM ledgers WHERE id = ?", (ledger_id,)).fetchall():
                    raise KeyError(ledger_id)
                (count,) = conn.execute("SELECT COUNT(*) FROM ledger_entries WHERE ledger = ?",
                                        (ledger_id,)).fetchone()
                if count != position:
                    raise LedgerConflict(f"ledger {ledger_id!r} has {count} entries, not {position}")
                _insert_entry(conn, ledger_id, position, entry)
                conn.execute("INSERT OR REPLACE INTO releases (aggregation, nbytes, crc32) VALUES (?, ?, ?)",
                             (key, len(release), zlib.crc32(release)))
                conn.execute("UPDATE aggregations SET state = ?, finished = ? WHERE key = ?", (FINALIZED, finished, key))
                raw = [name for (name,) in conn.execute("SELECT file FROM checkpoints WHERE aggregation = ?", (key,))]
                conn.execute("DELETE FROM checkpoints WHERE aggregation = ?", (key,))
            _remove_files(directory, raw)
            _fsync_dir(directory)

    def load_release(self, aggregation_id: str) -> bytes | None:
        with self._files_lock:
            key = self._key(aggregation_id)
            rows = self._query("SELECT nbytes, crc32 FROM releases WHERE aggregation = ?", (key,)) if key else []
            if not rows:
                return None
            nbytes, crc = rows[0]
            with open(os.path.join(self._state_dir(key), RELEASE_FILE), "rb") as f:
                blob = f.read()
            if len(blob) != nbytes or zlib.crc32(blob) != crc:
                raise CorruptStateError(f"the release of aggregation {aggregation_id!r} does not match its row")
            return blob

    def close(self) -> None:
        """Closes the SQLite connection (a second call does nothing)."""
        with self._db_lock:
            self._conn.close()
        self._sweep_lock.close()
        if self._lock_file is not None:
            self._lock_file.close()  # releases the directory for another process


# Helpers ----------------------------------------------------------------------------------
SWEEP_WAIT = 10.0  # seconds an opening owner waits for an earlier owner's shard processes to exit


def _wait_for_lock(f, timeout: float) -> bool:
    """Takes ``f``'s flock exclusively, waiting up to ``timeout`` seconds; False if it could not."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _lock_exclusively(path: str):
    """An open lock file holding an exclusive ``flock``: one process per data directory.

    Two servers on one directory would sweep each other's in-flight files. The
    kernel drops the lock when the process dies, SIGKILL included.
    """
    f = open(path, "a+b")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RuntimeError(f"{os.path.dirname(path)} is in use by another clipd process") from None
    return f


def _epoch(conn: sqlite3.Connection, key: int, shard: int) -> int:
    row = conn.execute("SELECT epoch FROM shard_epochs WHERE aggregation = ? AND shard = ?", (key, shard)).fetchone()
    return row[0] if row else 0


def _insert_entry(conn: sqlite3.Connection, ledger_id: str, position: int, entry: LedgerEntry) -> None:
    conn.execute("INSERT INTO ledger_entries (ledger, position, aggregation_id, event, time, epsilon_after, next_bound)"
                 " VALUES (?, ?, ?, ?, ?, ?, ?)", (ledger_id, position, entry.aggregation_id, entry.event, entry.time,
                                                   entry.epsilon_after, entry.next_bound))


def _record(row: tuple) -> AggregationRecord:
    aggregation_id, spec, state, created, finished, reason = row
    return AggregationRecord(aggregation_id, spec, state, created, finished, reason)



def _fsync_dir(path: str) -> None:
    """Makes the directory's entries (created, renamed, removed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dir(path: str) -> None:
    """Creates ``path`` (mode 0o700) if missing, durably: its parent's entry is fsynced."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        return
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _write_durably(directory: str, name: str, data: bytes) -> None:
    """``directory/name`` holds ``data`` on disk, or (after a crash) is absent or the old file."""
    tmp = os.path.join(directory, name + ".tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(directory, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _remove_files(directory: str, names: list[str]) -> None:
    """Unlinks files of ``directory`` (already missing ones are fine)."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
