"""TLS for the gRPC server (optionally mutual) and HTTPS for the admin API, from the settings.

- ``tls_cert_file`` and ``tls_key_file`` set: gRPC accepts TLS connections only,
  and the admin API serves HTTPS with the same certificate and key.
- ``tls_client_ca_file`` set as well: gRPC also requires a client certificate
  signed by that CA (mutual TLS). The admin API does not ask for client
  certificates: browsers and Prometheus scrapers rarely have one, and the
  admin API authenticates with the admin bearer token (``admin_token``) instead.
"""

from __future__ import annotations

import pathlib
from typing import Any

import grpc

from clipd.server.settings import Settings


def tls_enabled(settings: Settings) -> bool:
    """Whether the server speaks TLS (gRPC) and HTTPS (admin API)."""
    return bool(settings.tls_cert_file)


def grpc_server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """The gRPC server credentials, or None when TLS is off (plaintext)."""
    if not tls_enabled(settings):
        return None
    key = pathlib.Path(settings.tls_key_file).read_bytes()
    chain = pathlib.Path(settings.tls_cert_file).read_bytes()
    if settings.tls_client_ca_file:
        client_ca = pathlib.Path(settings.tls_client_ca_file).read_bytes()
        return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca,
                                           require_client_auth=True)
    return grpc.ssl_server_credentials([(key, chain)])


def peer_channel(settings: Settings, target: str, options=()) -> grpc.Channel:
    """A channel from one of clipd's processes to another (a Ray shard host to the server or to another host).

    Plaintext on a unix socket (a private directory of one host) or when TLS is off; else TLS, verified
    against ``tls_peer_ca_file`` (or ``tls_client_ca_file``, or the system's CAs) with ``tls_peer_name``
    as the expected name when set, presenting ``tls_cert_file`` as the client certificate (mutual TLS).
    """
    if target.startswith("unix:") or not tls_enabled(settings):
        return grpc.insecure_channel(target, options=list(options))
    ca = settings.tls_peer_ca_file or settings.tls_client_ca_file
    credentials = grpc.ssl_channel_credentials(
        pathlib.Path(ca).read_bytes() if ca else None, pathlib.Path(settings.tls_key_file).read_bytes(),
        pathlib.Path(settings.tls_cert_file).read_bytes())
    options = [*options, *([("grpc.ssl_target_name_override", settings.tls_peer_name)] if settings.tls_peer_name
                           else [])]
    return grpc.secure_channel(target, credentials, options=options)


def admin_ssl_kwargs(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config``: HTTPS with the gRPC certificate, or nothing (HTTP).

    Client certificates are never requested here, even with mutual TLS on gRPC
    (see the module docstring): the admin API relies on the bearer token.
    """
    if not tls_enabled(settings):
        return {}
    return {"ssl_certfile": settings.tls_cert_file, "ssl_keyfile": settings.tls_key_file}
