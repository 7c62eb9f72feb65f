"""clipd: clip per-example updates to an L2 bound and keep their sums, as a gRPC service.

The import packages are ``clipd.engine`` (pure JAX math, folder ``engine/``),
``clipd.server`` (``server/``), ``clipd.client`` (``client/``) and ``clipd.v1``
(the generated gRPC code, ``proto/clipd/v1/``).
"""

__version__ = "0.1.0"
