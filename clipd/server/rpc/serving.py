"""One function that builds a process that serves Clipd: ``clipd serve`` and each of its shard hosts.

:func:`serving_process` makes the parts every such process has, in one order: the compilation cache, the
ledgers, the lifecycle over the process's registry and shards, the servicer (with its credentials), and a gRPC
server with its thread pool, the role guard, the handlers, health and reflection. What differs is passed in: the
store and registry (a shard host opens aggregations from the shared store), the shards (this process's devices,
or the shard hosts a control process supervises), which credential is the admin's (a shard host checks Submit's
roles itself and passes every other call on), the handlers and the pool's thread names. :func:`listen` adds a
port, with TLS when the settings have a certificate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from clipd.server.aggregations import Registry
from clipd.server.credentials import SubmitTokens
from clipd.server.lifecycle import Lifecycle, Shards
from clipd.server.privacy import Ledgers
from clipd.server.rpc.limits import ServerPool
from clipd.server.rpc.reflection import enable_reflection
from clipd.server.rpc.server import OTHER_STREAMS, SERVICE_NAME, Guard, server_options
from clipd.server.rpc.service import ClipdServicer
from clipd.server.settings import Settings
from clipd.server.stores.base import Store
from clipd.server.tls import grpc_server_credentials


@dataclasses.dataclass
class ServingProcess:
    """The parts of one process that serves Clipd (see :func:`serving_process`)."""

    store: Store
    registry: Registry  # (a shard host's opens aggregations from the store)
    shards: Shards
    ledgers: Ledgers
    lifecycle: Lifecycle
    servicer: ClipdServicer
    guard: Guard
    grpc: grpc.Server
    health: health.HealthServicer

    def set_serving(self, serving: bool) -> None:
        """What its health service answers (for every service and the server as a whole)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)


def use_compilation_cache(settings: Settings) -> None:
    """JAX's persistent compilation cache in ``settings.compilation_cache_dir`` (a restart's programs are read
    back, not compiled), when set."""
    if settings.compilation_cache_dir:
        import jax

        jax.config.update("jax_compilation_cache_dir", settings.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def serving_process(settings: Settings, store: Store, registry, make_shards: Callable[[], Shards], *, admin_token: str,
                    handlers: Callable[[ClipdServicer], Sequence[grpc.GenericRpcHandler]], role: str,
                    options: Sequence[tuple[str, int]] | None = None,
                    ledgers: Ledgers | None = None) -> ServingProcess:
    """A process's Clipd: the compilation cache set, then its shards (``make_shards()``: this process's devices, or
    the supervisor of its shard hosts), its ledgers (``ledgers``, or new ones on ``store``), lifecycle, servicer and
    gRPC server.

    ``admin_token``: the credential the guard takes as the admin's ("": the guard lets every call through to the
    handlers, which check Submit's roles themselves). ``handlers(servicer)``: the gRPC handlers to serve. The pool
    has a thread for each Submit stream (``max_streams``), each other stream, and ``unary_workers`` more that only
    unary RPCs and health checks can use, whatever the streams do; its threads are named ``clipd-grpc-<role>``.
    No global RPC cap (gRPC's refuses health checks too): Submit streams beyond ``max_streams`` are refused, others
    wait.
    """
    use_compilation_cache(settings)  # before anything compiles (devices run a first program as they start)
    shards = make_shards()
    ledgers = ledgers if ledgers is not None else Ledgers(store)
    lifecycle = Lifecycle(settings, registry, shards, store, ledgers)
    servicer = ClipdServicer(settings, lifecycle, SubmitTokens(store.submit_token_key()))
    guard = Guard(admin_token, servicer)
    server = grpc.server(
        ServerPool(max_workers=settings.max_streams + OTHER_STREAMS + settings.unary_workers,
                   thread_name_prefix=f"clipd-grpc-{role}"),
        options=list(options if options is not None else server_options(settings)), interceptors=[guard])
    server.add_generic_rpc_handlers(tuple(handlers(servicer)))
    checks = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    enable_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server)
    return ServingProcess(store, registry, shards, ledgers, lifecycle, servicer, guard, server, checks)


def listen(server: grpc.Server, settings: Settings, port: int) -> int:
    """Adds ``settings.host:port`` to ``server`` (0: a free port), with TLS (mutual with a client CA) when the
    settings have a certificate; the port bound."""
    address = f"{settings.host}:{port}"
    credentials = grpc_server_credentials(settings)
    if credentials is not None:
        return server.add_secure_port(address, credentials)
    return server.add_insecure_port(address)
