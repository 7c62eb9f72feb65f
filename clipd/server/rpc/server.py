"""The gRPC server's own pieces: its options, the role guard in front of every call, Clipd's handlers.

Used by every process that serves Clipd: ``clipd serve`` (:mod:`clipd.server.app`) and its shard
processes and Ray shard hosts (:mod:`clipd.server.shards`).
"""

from __future__ import annotations

import collections

import grpc

from clipd import wire
from clipd.server.credentials import bearer_token, same
from clipd.server.errors import ClipdError, PermissionDenied, ResourceExhausted, Unauthenticated
from clipd.server.rpc.codec import lenient
from clipd.server.rpc.limits import StreamSlots, on_pool
from clipd.server.rpc.service import ClipdServicer
from clipd.server.settings import Settings
from clipd.v1 import clipd_pb2

INGEST_METADATA = "x-clipd-ingest"  # which shard process (or host) forwarded a call (counted by the server)
SERVICE_NAME = clipd_pb2.DESCRIPTOR.services_by_name["Clipd"].full_name
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
SUBMIT_TO_STREAM_METHOD = f"/{SERVICE_NAME}/SubmitToStream"
ONE_MESSAGE_METHODS = (wire.SUBMIT_ONE_METHOD, SUBMIT_TO_STREAM_METHOD)  # run on the admission's pool


# Methods a submit token may call: the handler checks the token against the aggregation.
SUBMIT_TOKEN_METHODS = (f"/{SERVICE_NAME}/Submit", wire.SUBMIT_ONE_METHOD, f"/{SERVICE_NAME}/GetAggregation",
                        f"/{SERVICE_NAME}/GetPlacement", SUBMIT_TO_STREAM_METHOD,
                        f"/{SERVICE_NAME}/GetStreamClient")
PENDING_CALLS = 16_384  # calls gRPC core holds for the server's loop before it drops any (server_options)
OTHER_STREAMS = 16  # Health/Watch and reflection streams at once (beside max_streams Submit streams)


class Guard(grpc.ServerInterceptor):
    """Roles and long-lived streams, before any handler runs.

    Roles (with an admin token set): health and reflection are open; Submit and
    GetAggregation need some bearer token (the handler checks it against the
    aggregation: a submit token may submit to its aggregation and read its spec);
    every other RPC needs the admin token: no credential is UNAUTHENTICATED, a
    submit token is PERMISSION_DENIED. Health ``Watch`` and reflection streams take one of
    ``OTHER_STREAMS`` slots, so they can't use up the threads of anything else. A one-message submission
    (SubmitOne, SubmitToStream) waits for its own pool's thread (``Admission``), or is refused at once with an
    appointment when that pool's queue is full: decided here, before anything of it is read.
    """

    def __init__(self, admin_token: str, servicer: ClipdServicer) -> None:
        self._admin_token = admin_token
        self._servicer = servicer
        self.forwarded: collections.Counter = collections.Counter()  # calls per shard process or Ray shard host
        self.ingest_indexes: frozenset[str] = frozenset()  # the values INGEST_METADATA may have
        self._other_streams = StreamSlots(OTHER_STREAMS, "health-watch and reflection stream")

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        for key, value in handler_call_details.invocation_metadata or ():
            if key == INGEST_METADATA and value in self.ingest_indexes:  # set by our shard processes or hosts only
                self.forwarded[value] += 1
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if method in ONE_MESSAGE_METHODS:
            admission = self._servicer.admission
            wait = admission.retry_after()
            if wait is not None:
                return _refusing(handler, self._servicer, ResourceExhausted(
                    f"{admission.held} one-message submissions are held ({admission.queue} may wait); come back"
                    f" in {wait:.2f} s", retry_after=wait), method)
        if method.startswith(OPEN_METHODS):
            return self._limited(handler, method) if handler.response_streaming else handler
        if not self._admin_token:
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if method in SUBMIT_TOKEN_METHODS or same(token, self._admin_token):
            return handler
        if token is None or not self._servicer.auth.is_credential(token):
            return _refusing(handler, self._servicer, Unauthenticated(
                "a valid 'authorization: Bearer <token>' is required"), method)
        return _refusing(handler, self._servicer, PermissionDenied(
            f"{method.rsplit('/', 1)[-1]} needs the admin credential; a submit token may only Submit"), method)

    def _limited(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner = handler.unary_stream or handler.stream_stream
        slots, servicer = self._other_streams, self._servicer

        def limited(request, context):
            try:
                slots.acquire()
            except ClipdError as e:
                servicer.refuse(context, e, method)
            try:
                yield from inner(request, context)
            finally:
                slots.release()

        return _with_behavior(handler, limited)


HANDLER_KINDS = {  # (request streaming, response streaming) -> how gRPC makes such a handler
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _with_behavior(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    make = HANDLER_KINDS[handler.request_streaming, handler.response_streaming]
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _refusing(handler: grpc.RpcMethodHandler, servicer: ClipdServicer, error: ClipdError, method: str):
    def refuse(request, context):
        servicer.refuse(context, error, method)

    def refuse_streaming(request, context):
        servicer.refuse(context, error, method)
        yield  # never reached: a generator, as a streaming response needs

    # The request is not parsed: a refused caller costs no deserialization.
    handler = handler._replace(request_deserializer=None)
    return _with_behavior(handler, refuse_streaming if handler.response_streaming else refuse)


def clipd_handlers(servicer) -> list[grpc.GenericRpcHandler]:
    """The Clipd service's handlers, made from its descriptor; Submit, SubmitOne and Step are parsed by ``wire``
    (no copies), and the one-message submissions (SubmitOne, SubmitToStream) run on the admission's pool: however
    many clients wait for their acknowledgements, the control calls keep the server's threads."""
    service = clipd_pb2.DESCRIPTOR.services_by_name["Clipd"]
    handlers = {}
    for method in service.methods:
        parse = getattr(clipd_pb2, method.input_type.name).FromString
        if method.name in ("Submit", "SubmitOne"):
            parse = wire.parse_submit_request
        elif method.name == "Step":
            parse = wire.parse_step_request
        parse = lenient(parse)  # bytes that do not parse: INVALID_ARGUMENT, not INTERNAL
        behavior = getattr(servicer, method.name)
        if f"/{service.full_name}/{method.name}" in ONE_MESSAGE_METHODS:
            behavior = on_pool(behavior, servicer.admission.pool)
        handlers[method.name] = HANDLER_KINDS[method.client_streaming, method.server_streaming](
            behavior,
            request_deserializer=parse,
            response_serializer=getattr(clipd_pb2, method.output_type.name).SerializeToString,
        )
    return [grpc.method_handlers_generic_handler(service.full_name, handlers)]


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """gRPC channel arguments: message limits and keepalive enforcement."""
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Probe connections quiet for 60 s and drop those whose peer does not answer in 20 s
        # (a vanished client frees its streams); refuse clients that ping more than every 10 s.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.max_connection_idle_ms", 15 * 60_000),  # connections with no RPC for 15 min are closed
        # Calls that arrived before the server's loop took them: gRPC core drops them at random past
        # 1,000 (the client sees a bare CANCELLED) and all past 3,000. A round of thousands of clients
        # arrives at once; they wait here instead (each is small) and are taken in order.
        ("grpc.server.max_pending_requests", PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", 4 * PENDING_CALLS),
    ]
