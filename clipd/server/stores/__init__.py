"""The stores: where aggregations, their checkpoints and privacy ledgers outlive the process.

One abstract :class:`~clipd.server.stores.base.Store` (and the in-memory one), one SQL base
(:mod:`.sql`) and two thin dialects: SQLite with checkpoint files on one machine
(:mod:`.sqlite`) and PostgreSQL shared by processes and hosts (:mod:`.postgres`).
:func:`open_store` picks one from ``data_dir``. The modules import one way only:
``base`` <- ``sql`` <- the dialects <- this package's :func:`open_store`.

May import: clipd.engine (``PartialState``), and of clipd.server only credentials (the
at-rest key). Nothing of the RPC surface, the shards or the lifecycle.
"""

from __future__ import annotations

from clipd.server.stores.base import MemoryStore, Store


def open_store(data_dir: str, *, sibling: bool = False) -> Store:
    """``"memory"``: a :class:`MemoryStore`; a ``postgresql://`` DSN: a PostgreSQL store; otherwise a SQLite store
    in that directory (created if need be).

    ``sibling``: opened by a shard process beside the clipd that holds the store (a SQLite directory is
    then shared, not locked; see :class:`~clipd.server.stores.sqlite.SQLiteStore`).
    """
    if data_dir == "memory":
        return MemoryStore()
    if data_dir.startswith(("postgresql://", "postgres://")):  # a shared store (the [postgres] extra)
        from clipd.server.stores.postgres import PostgresStore

        return PostgresStore(data_dir)
    from clipd.server.stores.sqlite import SQLiteStore

    return SQLiteStore(data_dir, sibling=sibling)
