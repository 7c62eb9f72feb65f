"""The stores: where aggregations, their checkpoints and privacy ledgers outlive the process.

One abstract :class:`~clipd.server.stores.base.Store` (and the in-memory one), one SQL base
(:mod:`.sql`) and two thin dialects: SQLite with checkpoint files on one machine
(:mod:`.sqlite`) and PostgreSQL shared by processes and hosts (:mod:`.postgres`).
:func:`~clipd.server.stores.base.open_store` picks one from ``data_dir``.

May import: clipd.engine (``PartialState``), and of clipd.server only credentials (the
at-rest key). Nothing of the RPC surface, the shards or the lifecycle.
"""
