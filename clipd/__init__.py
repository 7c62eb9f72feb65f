"""clipd: clip per-example updates to an L2 bound and keep their sums, as a gRPC service.

Its packages, in the order the data meets them: ``clipd.client`` (what a trainer or federated
server calls), ``clipd.v1`` (the gRPC code generated from ``proto/clipd/v1/clipd.proto``),
``clipd.server`` (the service) and ``clipd.engine`` (the clipping math, pure JAX).
docs/ARCHITECTURE.md draws them.
"""

__version__ = "0.1.0"
