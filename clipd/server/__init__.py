"""clipd.server: the gRPC service, its device worker, store and admin API.

It needs the ``server`` extra (``pip install '.[server]'``): a plain
``pip install .`` is the client side only (numpy, grpcio, protobuf), so that
it installs beside Flower. Importing this package without the extra fails at
once with an ImportError that says so, rather than deep inside a submodule.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

# import name -> distribution, for what the server imports beyond the client's dependencies
_NEEDS = {
    "jax": "jax",
    "dp_accounting": "dp-accounting",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "prometheus_client": "prometheus-client",
    "swagger_ui_bundle": "swagger-ui-bundle",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
}
_PROTOBUF_MAJOR = 7  # grpcio-health-checking / grpcio-reflection 1.85 need protobuf >= 7.35


def _missing() -> list[str]:
    missing = [dist for module, dist in _NEEDS.items() if importlib.util.find_spec(module) is None]
    try:
        protobuf = importlib.metadata.version("protobuf")
        if int(protobuf.split(".")[0]) < _PROTOBUF_MAJOR:
            missing.append(f"protobuf>=7 (found {protobuf})")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        missing.append("protobuf>=7")
    return missing


if _missing():
    raise ImportError(
        "clipd.server needs the server extra: pip install '.[server]' "
        f"(missing: {', '.join(_missing())})",
        name=__name__,
    )
