"""The RPC surface: what arrives over gRPC, checked and turned into calls on an aggregation.

Owns the Clipd servicer (:mod:`.service`), the conversions between protobuf messages and the
engine's types (:mod:`.codec`; the wire format itself is :mod:`clipd.wire`), the reassembly of a
batch from its chunks (:mod:`.batches`), admission limits (:mod:`.limits`), the role guard and
gRPC options (:mod:`.server`) and reflection (:mod:`.reflection`).

May import: clipd.v1, clipd.wire, clipd.engine (its types), and of clipd.server the lifecycle
(aggregations, privacy), the stores, the shards' interface, errors, settings, credentials, logs.
Not the admin app nor the composition in :mod:`clipd.server.app`.
"""
