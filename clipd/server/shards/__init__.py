"""The shards: where accepted batches are clipped and summed, one shard of an aggregation at a time.

Four kinds, one interface (:class:`clipd.server.lifecycle.Shards`): the local devices of this
process (:mod:`.local`, one :mod:`.worker` thread per JAX device), shard processes on this host
(:mod:`.process`), and on Ray shard actors and shard hosts (:mod:`.ray_actors`); :mod:`.ingest` passes calls
through to a server byte for byte.

May import: clipd.engine, clipd.v1, and of clipd.server the lifecycle (aggregations), the
stores, errors, settings, credentials, tls, logs, and the RPC surface (a shard process serves
Clipd itself). Nothing imports a shard kind but :mod:`clipd.server.app`.
"""
