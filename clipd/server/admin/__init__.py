"""The admin HTTP API (FastAPI): health, aggregation snapshots, Prometheus metrics, the dashboard.

Reads host-side snapshots of the lifecycle (:mod:`clipd.server.aggregations`); imports nothing
of the RPC surface, the shards or the stores.
"""
