"""The shards: where accepted batches are clipped and summed, one shard of an aggregation at a time.

Three kinds, one interface (:class:`clipd.server.lifecycle.Shards`) and one summing runtime: the
local devices of this process (:mod:`.local`, one :mod:`.worker` thread per JAX device), shard
processes on this host (:mod:`.process`, each with its own local devices), and the same shard
processes as Ray actors on a cluster's nodes (:mod:`.ray_hosts`); :mod:`.forward` passes a call on
to the process that answers it, byte for byte.

May import: clipd.engine, clipd.v1, and of clipd.server the lifecycle (aggregations), the
stores, errors, settings, credentials, tls, logs, and the RPC surface (a shard process serves
Clipd itself). Nothing imports a shard kind but :mod:`clipd.server.app`.
"""
