"""Forwarding a call, byte for byte, from a shard process to the process that answers it.

A shard host (:mod:`clipd.server.shards.host`: a shard process of ``--processes``, a Ray host) passes every call but
Submit to the control process, and a Submit for another process's shard to that process: the caller's
metadata (its bearer token) goes along, with which process forwarded it, and the answer's status comes back
as it was. Also the port the shard processes share (:func:`reserve_port`).
"""

from __future__ import annotations

import logging
import socket
import threading

import grpc

from clipd.server.credentials import CERTIFIED_CLIENT_METADATA, certificate_client_id
from clipd.server.rpc.server import INGEST_METADATA
from clipd.server.rpc.submit import PEER_METADATA
from clipd.v1 import clipd_pb2

SERVICE = clipd_pb2.DESCRIPTOR.services_by_name["Clipd"]
log = logging.getLogger(__name__)


def _forwarded_metadata(context, index: int, vouch=None) -> list[tuple[str, str]]:
    """The caller's metadata (its bearer token), and which shard process forwards it (the caller's own dropped);
    ``vouch``: with mutual TLS, the caller's certificate's client id, vouched for (``ClientTokens.vouch``)."""
    ours = ("user-agent", INGEST_METADATA, PEER_METADATA, CERTIFIED_CLIENT_METADATA)
    keep = [(k, v) for k, v in context.invocation_metadata() if not k.startswith((":", "grpc-")) and k not in ours]
    certified = certificate_client_id(context) if vouch is not None else None
    return [*keep, (INGEST_METADATA, str(index)), (PEER_METADATA, context.peer() or ""),
            *([(CERTIFIED_CLIENT_METADATA, vouch(certified))] if certified is not None else [])]


def _relay(context, error: grpc.RpcError) -> None:
    """Ends the client's call with the server process's status (``abort`` raises)."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    if trailing:
        context.set_trailing_metadata(tuple(trailing))
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNAVAILABLE
    if code is grpc.StatusCode.UNAVAILABLE and not (error.details() or "").strip():
        context.abort(code, "the server process is not reachable")
    context.abort(code, error.details() or "")


def _timeout(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e6 else max(0.001, remaining)


def passing_through(channel: grpc.Channel, index: int, submit=None, placement=None,
                    submit_one=None) -> grpc.GenericRpcHandler:
    """The Clipd service, every call passed through to ``channel`` with its metadata and ``index`` added.

    ``submit``: Submit's own handler (raw bytes in and out) instead of passing it through too;
    ``placement``: GetPlacement's own handler (bytes in and out), likewise; ``submit_one``: SubmitOne's.
    """
    handlers = {}
    for method in SERVICE.methods:
        path = f"/{SERVICE.full_name}/{method.name}"
        if method.name == "GetPlacement" and placement is not None:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(placement)
        elif method.name == "SubmitOne" and submit_one is not None:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(submit_one)
        elif method.name == "Submit":
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                submit or _pass(channel.stream_stream(path), index, streaming_in=True))
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _pass(channel.unary_stream(path), index))
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(_pass_unary(channel.unary_unary(path), index))
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


def _pass_unary(call, index: int, vouch=None):
    """A unary call passed on; ``vouch``: see :func:`_forwarded_metadata`."""
    def forward(request: bytes, context):
        try:
            future = call.future(request, metadata=_forwarded_metadata(context, index, vouch),
                                 timeout=_timeout(context))
            context.add_callback(future.cancel)
            return future.result()
        except grpc.RpcError as e:
            _relay(context, e)

    return forward


def _pass(call, index: int, streaming_in: bool = False, vouch=None):
    """A call whose answers stream back (Finalize; Submit, whose requests stream too); ``vouch``: see
    :func:`_forwarded_metadata`."""

    def forward(request, context):
        outgoing = []  # the call below, once made
        made = threading.Event()
        if streaming_in:
            request = _until_the_client_leaves(request, outgoing, made, context.peer())
        responses = call(request, metadata=_forwarded_metadata(context, index, vouch),
                         timeout=None if streaming_in else _timeout(context))
        outgoing.append(responses)
        made.set()
        context.add_callback(responses.cancel)
        try:
            yield from responses
        except grpc.RpcError as e:
            _relay(context, e)

    return forward


def _until_the_client_leaves(requests, outgoing: list, made: threading.Event, peer: str):
    """The client's requests, passed on. A client that goes away (its call cancelled or its connection cut) is an
    ordinary event: the outgoing call is cancelled (the receiving process must not read a half-close, a finished
    stream, from it) and one INFO line says so, where gRPC would log "Exception iterating requests!" with a
    traceback at ERROR."""
    try:
        yield from requests
    except grpc.RpcError:
        made.wait(5.0)  # (the call starts reading before it is returned)
        for call in outgoing:
            call.cancel()
        log.info("client %s went away mid-stream; its forwarded stream is cancelled", peer,
                 extra={"event": "submit.client_gone"})


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, not listening, SO_REUSEPORT socket: holds the port (``0``: a free one) for the shard processes."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host.strip("[]"), port))
    return sock
