"""The processes that sum: shard processes on this host and Ray shard hosts, and what passes a call between them.

The summing runtime itself (a device worker per JAX device) is :mod:`clipd.server.summing`; this package hosts it
in processes of its own: shard processes on this host (:mod:`.process`, each with its own local devices) and the
same shard processes as Ray actors on a cluster's nodes (:mod:`.ray_hosts`); :mod:`.forward` passes a call on to
the process that answers it, byte for byte. Each kind is a :class:`clipd.server.lifecycle.Shards`.

May import: clipd.engine, clipd.v1, and of clipd.server the summing runtime, the RPC surface (a shard process
serves Clipd itself), the lifecycle, the stores, errors, settings, credentials, tls, logs and the internal
protocol. Nothing imports a shard kind but :mod:`clipd.server.app`.
"""
