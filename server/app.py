"""Building and running the server: gRPC (with health and reflection), the worker, the admin API."""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from clipd.v1 import clipd_pb2

from . import codec, wire
from .aggregations import Aggregation, Registry
from .reflection import enable_reflection
from .service import ClipdServicer
from .settings import Settings
from .store import FAILED, FINALIZED, Store, open_store
from .worker import DeviceWorker

log = logging.getLogger(__name__)
SERVICE_NAME = clipd_pb2.DESCRIPTOR.services_by_name["Clipd"].full_name
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class _TokenAuth(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every RPC but health checks and reflection."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHODS):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if metadata.get("authorization") == self._expected:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _denying_handler(handler)


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid 'authorization: Bearer <token>' is required")

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


def _clipd_handlers(servicer) -> grpc.GenericRpcHandler:
    """The Clipd service's handlers, made from its descriptor; Submit is parsed by ``wire`` (no copies)."""
    service = clipd_pb2.DESCRIPTOR.services_by_name["Clipd"]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in service.methods:
        parse = getattr(clipd_pb2, method.input_type.name).FromString
        if method.name == "Submit":
            parse = wire.parse_submit_request
        handlers[method.name] = kinds[method.client_streaming, method.server_streaming](
            getattr(servicer, method.name),
            request_deserializer=parse,
            response_serializer=getattr(clipd_pb2, method.output_type.name).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


class ClipdServer:
    """The running service: gRPC server, device worker, registry, and (optionally) the admin API."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        if settings.compilation_cache_dir:
            import jax

            jax.config.update("jax_compilation_cache_dir", settings.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        self.store = open_store(settings.data_dir)
        self.registry = Registry(settings.max_aggregations)
        self.worker = DeviceWorker(settings.max_buffered_bytes, self.store, settings.checkpoint_interval,
                                   settings.checkpoint_max_duty)
        recover(self.store, self.registry, self.worker, settings)
        self.servicer = ClipdServicer(settings, self.registry, self.worker, self.store)
        self.health = health.HealthServicer()
        options = [
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        interceptors = [_TokenAuth(settings.admin_token)] if settings.admin_token else []
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=settings.max_streams + settings.unary_workers, thread_name_prefix="clipd-grpc"),
            options=options,
            interceptors=interceptors,
            maximum_concurrent_rpcs=settings.max_streams + settings.unary_workers,
        )
        self.grpc.add_generic_rpc_handlers((_clipd_handlers(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        enable_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), self.grpc)
        address = f"{settings.host}:{settings.grpc_port}"
        from .tls import grpc_server_credentials

        credentials = grpc_server_credentials(settings)  # TLS, or mutual TLS with tls_client_ca_file
        if credentials is not None:
            self.port = self.grpc.add_secure_port(address, credentials)
        else:
            self.port = self.grpc.add_insecure_port(address)
        self.admin = None
        self.stopped = threading.Event()
        self._janitor = threading.Thread(target=self._expire_results, name="clipd-janitor", daemon=True)

    def _expire_results(self) -> None:
        """Deletes finalized and failed aggregations once they are older than the retention period."""
        period = min(60.0, self.settings.retention_seconds / 4)
        while not self.stopped.wait(period):
            for aggregation in self.registry.expired(time.time() - self.settings.retention_seconds):
                try:
                    self.servicer.cancel(aggregation.id)
                    log.info("aggregation %s expired (retention %g s)", aggregation.id,
                             self.settings.retention_seconds)
                except Exception:  # already gone, or the store failed: try again next round
                    log.exception("could not expire aggregation %s", aggregation.id)

    def start(self) -> ClipdServer:
        self.grpc.start()
        self._janitor.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("clipd gRPC on %s:%d (device: %s)", self.settings.host, self.port, self.worker.device_kind)
        if self.settings.admin_port >= 0:
            from .admin import start_admin

            self.admin = start_admin(self, self.settings)
            log.info("clipd admin API on %s://%s:%d", self.admin.scheme, self.settings.host, self.admin.port)
        return self

    @property
    def serving(self) -> bool:
        """Ready for traffic: gRPC started, not stopping, and the device worker warmed up."""
        return not self.stopped.is_set() and self.worker.ready.is_set()

    def stop(self, grace: float = 10.0) -> None:
        """Graceful: refuse new RPCs, let open streams finish for ``grace`` s, sum what was accepted."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.health.enter_graceful_shutdown()
        self.grpc.stop(grace).wait()
        self.worker.stop()
        self.store.close()
        if self.admin is not None:
            self.admin.stop()


def recover(store: Store, registry: Registry, worker: DeviceWorker, settings: Settings) -> None:
    """Brings back every aggregation of the store as of its last checkpoint.

    Open ones warm up again and keep taking batches: their clients resume after
    the checkpoint's sequence numbers (anything older is a duplicate). Finalized
    ones serve their result again; failed ones keep their reason.
    """
    for record in store.records():
        layers, policy, reject = codec.spec_from_json(record.spec)
        totals = store.load_checkpoint(record.aggregation_id, newest_only=record.state == FINALIZED)
        aggregation = Aggregation(record.aggregation_id, layers, policy, reject, settings.max_device_rows,
                                  settings.staging_bytes, recovered=totals, created=record.created)
        if record.state == FINALIZED and totals is not None:
            aggregation.restore_result(record.finished)
        elif record.state == FINALIZED:
            aggregation.fail("the final checkpoint can't be read back")
        elif record.state == FAILED:
            aggregation.fail(record.reason)
            aggregation.finished = record.finished
        else:
            worker.warm_up(aggregation)
        registry.add(aggregation)
        log.info("recovered aggregation %s: %s, %d examples", record.aggregation_id,
                 aggregation.state.value, aggregation.examples)


def create_server(settings: Settings) -> tuple[ClipdServer, int]:
    """A started server and the port it listens on (``grpc_port=0`` picks a free one)."""
    server = ClipdServer(settings).start()
    return server, server.port


def serve(settings: Settings) -> None:
    """Runs until SIGINT or SIGTERM, then stops gracefully."""
    server, port = create_server(settings)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    admin = f", admin API on {server.admin.scheme}://{settings.host}:{server.admin.port}" if server.admin else ""
    print(f"clipd serving gRPC on {settings.host}:{port}{admin}", flush=True)
    done.wait()
    server.stop()
