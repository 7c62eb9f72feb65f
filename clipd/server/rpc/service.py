"""The gRPC servicer: thin methods over plain handlers; ClipdError becomes a status in one place.

Request path of a batch: ``Submit`` (a reader thread per stream) ->
``BatchAssembler.add`` (chunks checked and reassembled) -> ``Lifecycle.submit``
(finite? under policy REJECT; ``Aggregation.accept``: sequence numbers, duplicates;
``Shards.submit``) -> the device worker's step, flush and checkpoint -> ``Aggregation.mark_durable``.
The stream acknowledges durable batches only; docs/ARCHITECTURE.md draws it hop by hop.

Abuse limits on that path: a stream takes one of ``max_streams`` slots (else
RESOURCE_EXHAUSTED with a retry hint); a batch reserves its bytes in the one
buffer budget of the server when its first chunk arrives; a stream that sends
nothing for ``stream_idle_timeout`` seconds is closed (UNAVAILABLE: the client
reconnects and resends what was not acknowledged); a message that does not
parse is INVALID_ARGUMENT. Whatever way a stream ends, its partial batch and
reservation are given back.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Generator, Iterator

import grpc

from clipd import wire
from clipd.engine import Unit
from clipd.server.aggregations import SELF_ASSERTED, Aggregation, State
from clipd.server.credentials import (
    CERTIFIED_CLIENT_METADATA,
    CLIENT,
    SUBMITTER,
    ClientToken,
    ClientTokens,
    SubmitTokens,
    bearer_token,
    certificate_client_id,
    same,
)
from clipd.server.errors import (
    ClipdError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from clipd.server.lifecycle import Lifecycle
from clipd.server.logs import event
from clipd.server.rpc import codec
from clipd.server.rpc.batches import BatchAssembler
from clipd.server.rpc.limits import ByteBudget, StreamSlots
from clipd.server.sequences import client_of
from clipd.server.settings import Settings
from clipd.v1 import clipd_pb2 as pb
from clipd.v1 import clipd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
CHUNK_OVERHEAD = 1024  # bytes of a FinalizeResponse besides the tensor data
RECEIVE_BUFFERS = 2  # updates of a large model whose receive buffers are prepared as its aggregation opens
RESUME_MIN_BYTES = 256 << 10  # a broken stream's batch is kept for a resuming stream from this much received on
RESUME_WAIT = 5.0  # seconds a resuming stream waits for the server to see its writer's old stream end
PROGRESS_PERIOD = 0.5  # seconds between progress messages of a stream whose batches the server is working on


class Malformed:
    """What a request deserializer returns for bytes that do not parse (the handler refuses it)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def lenient(parse):
    """``parse`` that returns :class:`Malformed` instead of raising: the RPC then gets INVALID_ARGUMENT.

    gRPC's own handling of a raising deserializer is INTERNAL, a traceback per
    message, and RPCs left half-open.
    """

    def parse_or_malformed(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # any parse failure: refused by the handler, with one log line
            return Malformed(f"{type(e).__name__}: {e}")

    return parse_or_malformed


def _status_on_error(method):
    """Maps a ClipdError raised by a handler to its gRPC status."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            if isinstance(request, Malformed):
                raise InvalidArgument(f"malformed {method.__name__} request: {request.reason}")
            return method(self, request, context)
        except ClipdError as e:
            self.refuse(context, e, method.__name__)

    return wrapper


def _check_id(value: str, what: str) -> str:
    if not codec.ID_PATTERN.match(value):
        raise InvalidArgument(f"{what}: 1-128 letters, digits, '-', '_' or '.', got {value!r}")
    return value


def _as_credential(client_id: str, named: str, what: str) -> str:
    """``named`` if it is the credential's ``client_id`` or one of its spread ids, the credential's if empty."""
    if not named:
        return client_id
    if named != client_id and client_of(check_client_id(named)) != client_id:
        raise PermissionDenied(f"{what} is for client {client_id!r}; it may not submit as {named!r}")
    return named


def _why_identities(aggregation: Aggregation) -> str:
    stream = aggregation.privacy.correlated if aggregation.privacy is not None else None
    return "; ".join(why for why, given in (
        ("its unit is client: one contribution per client", aggregation.unit is Unit.CLIENT),
        ("its ledger's correlated noise stream limits each client's participation",
         stream is not None and not stream.declared)) if given)


def check_client_id(value: str) -> str:
    """A client id, or one stream of a spread submission: ``<client id>~<stream number>`` (``alice~3``)."""
    base, mark, stream = value.rpartition(wire.SPREAD_MARK)
    if mark and stream.isdigit() and len(stream) <= 6 and codec.ID_PATTERN.match(base) and stream[0] != "0":
        return value
    return _check_id(value, "client_id")


class ClipdServicer(pb_grpc.ClipdServicer):
    """Clipd's RPCs: who may call, what the request says (``codec``), then one call on the ``lifecycle``."""

    def __init__(self, settings: Settings, lifecycle: Lifecycle, submit_tokens: SubmitTokens) -> None:
        self.settings = settings
        self.lifecycle = lifecycle
        self.registry = lifecycle.registry
        self.submit_tokens = submit_tokens
        self.client_tokens = ClientTokens(submit_tokens.key)
        self.budget = ByteBudget(settings.max_buffered_bytes or self._memory_left)
        self.stream_slots = StreamSlots(settings.max_streams, "Submit stream")
        self.rejections: dict[str, int] = {}  # gRPC status name -> count
        self.payload_bytes = 0  # tensor bytes of the batches that Submit streams delivered to this process
        self._lock = threading.Lock()
        # Batches broken streams left partly received, by (aggregation, client): (writer, partial), each
        # kept by its stream's reader thread for stream_idle_timeout, for a resuming stream of that writer.
        self._parked: dict[tuple[str, str], list] = {}
        self._parked_cond = threading.Condition()

    def _memory_left(self) -> int:
        """The buffer for updates in flight in this process: its share of the memory budget, less the sums of
        the aggregations open here (a shard process holds about its share of each aggregation's shards)."""
        share = max(1, self.settings.processes)
        return max(0, self.settings.memory // share - self.registry.state_bytes() // share)

    def prepare_receive_buffers(self, devices) -> None:
        """``devices`` (``Devices``, in the process that receives what they sum) prepare, as an aggregation whose
        updates span messages opens, the receive buffers of its first ``RECEIVE_BUFFERS`` updates: faulted in
        before it opens (``ByteBudget.prepare``), as far as the buffer has room."""
        def prepare(aggregation: Aggregation) -> None:
            sizes = [layer.size * wire.numpy_dtype(layer.dtype).itemsize for layer in aggregation.layers]
            self.budget.prepare(sizes, RECEIVE_BUFFERS)

        devices.prepare_receive, devices.prepare_above = prepare, self.settings.max_message_bytes

    @property
    def active_streams(self) -> int:
        return self.stream_slots.active

    def refuse(self, context, error: ClipdError, method: str) -> None:
        """Counts, logs (one line) and sends a refusal; ``context.abort`` raises."""
        with self._lock:
            self.rejections[error.code.name] = self.rejections.get(error.code.name, 0) + 1
        event(log, "request.refused", method=method, code=error.code.name, peer=context.peer(),
              reason=str(error))
        metadata = error.trailing_metadata()
        if metadata:
            context.set_trailing_metadata(metadata)
        context.abort(error.code, str(error))

    # Aggregations -----------------------------------------------------------------------
    @_status_on_error
    def CreateAggregation(self, request: pb.CreateAggregationRequest, context) -> pb.Aggregation:
        layers = codec.layers_from_proto(request.layers)
        check_limits(layers, self.settings)
        policy, reject = codec.policy_from_proto(request.policy, len(layers))
        requested = _check_id(request.aggregation_id, "aggregation_id") if request.aggregation_id else ""
        privacy = codec.privacy_from_proto(request.privacy) if request.HasField("privacy") else None
        unit = codec.unit_from_proto(request.unit)
        return self._describe(self.lifecycle.create(requested, layers, policy, reject, privacy, unit,
                                                    request.self_asserted_client_ids))

    @_status_on_error
    def GetAggregation(self, request: pb.GetAggregationRequest, context) -> pb.Aggregation:
        """All of it for the admin; its spec and state only for a holder of its submit token."""
        token = bearer_token(context.invocation_metadata())
        aggregation = self.check_submitter(token, request.aggregation_id, "read")
        if self.is_admin(token):
            return self._describe(aggregation)
        return pb.Aggregation(aggregation_id=aggregation.id, layers=wire.layer_specs(aggregation.layers),
                              policy=codec.policy_to_proto(aggregation.policy, aggregation.reject_non_finite),
                              state=codec.STATES[aggregation.state], layer_bounds=aggregation.accumulator.bounds,
                              privacy=codec.privacy_to_proto(aggregation.privacy) if aggregation.privacy else None,
                              unit=wire.UNITS[aggregation.unit.value], client_ids=aggregation.client_ids)

    @_status_on_error
    def ListAggregations(self, request, context) -> pb.ListAggregationsResponse:
        return pb.ListAggregationsResponse(aggregations=[self._describe(a) for a in self.registry.all()])

    @_status_on_error
    def CancelAggregation(self, request: pb.CancelAggregationRequest, context) -> pb.Aggregation:
        return self._describe(self.lifecycle.cancel(request.aggregation_id))

    @_status_on_error
    def GetStats(self, request: pb.GetStatsRequest, context) -> pb.AggregationStats:
        return codec.stats_to_proto(self.registry.get(request.aggregation_id).stats())

    def Finalize(self, request: pb.FinalizeRequest, context):
        try:
            if isinstance(request, Malformed):
                raise InvalidArgument(f"malformed Finalize request: {request.reason}")
            limit = self.chunk_limit(request.max_chunk_bytes)
            self.budget.drop_pool()  # receive buffers are not kept past a round: its result needs the room
            result = self.lifecycle.finalize(request.aggregation_id)
        except ClipdError as e:
            self.refuse(context, e, "Finalize")
        yield pb.FinalizeResponse(stats=codec.stats_to_proto(result.stats))
        for k, total in enumerate(result.sums):
            for chunk in codec.tensor_chunks(k, total, limit - CHUNK_OVERHEAD):
                yield pb.FinalizeResponse(sum=chunk)

    def chunk_limit(self, requested: int) -> int:
        """The largest Finalize message: ``requested`` (0: 1 MiB), at least 64 KiB, at most the server's limit."""
        if 0 < requested < wire.FINALIZE_MIN_CHUNK_BYTES:
            raise InvalidArgument(f"max_chunk_bytes: at least {wire.FINALIZE_MIN_CHUNK_BYTES} (or 0 for the default),"
                                  f" got {requested}")
        return min(requested or wire.FINALIZE_DEFAULT_CHUNK_BYTES, self.settings.max_message_bytes)

    def _describe(self, aggregation: Aggregation) -> pb.Aggregation:
        return pb.Aggregation(
            aggregation_id=aggregation.id,
            layers=wire.layer_specs(aggregation.layers),
            policy=codec.policy_to_proto(aggregation.policy, aggregation.reject_non_finite),
            state=codec.STATES[aggregation.state],
            layer_bounds=aggregation.accumulator.bounds,
            examples=aggregation.examples,
            created_unix_seconds=aggregation.created,
            failure_reason=aggregation.failure_reason,
            submit_token=self.submit_tokens.token_for(aggregation.id, aggregation.created),
            privacy=codec.privacy_to_proto(aggregation.privacy) if aggregation.privacy else None,
            planned_ledger_epsilon=aggregation.planned_epsilon,
            unit=wire.UNITS[aggregation.unit.value],
            client_ids=aggregation.client_ids,
        )

    @_status_on_error
    def IssueClientToken(self, request: pb.IssueClientTokenRequest, context) -> pb.ClientToken:
        """A credential for one client id (or a trusted submitter) on an aggregation or a ledger (admin only)."""
        if request.role not in wire.TOKEN_ROLES.values():
            raise InvalidArgument(f"role: unknown value {request.role} (CLIENT or SUBMITTER)")
        role = CLIENT if request.role == pb.IssueClientTokenRequest.CLIENT else SUBMITTER
        if bool(request.aggregation_id) == bool(request.ledger_id):
            raise InvalidArgument("give one of aggregation_id (a token for that aggregation) and ledger_id (for every"
                                  " aggregation of that ledger)")
        client_id = _check_id(request.client_id, "client_id") if role == CLIENT else ""
        if role == SUBMITTER and request.client_id:
            raise InvalidArgument("client_id: a submitter token names no client (it may submit as any)")
        if not (request.ttl_seconds >= 0 and math.isfinite(request.ttl_seconds)):
            raise InvalidArgument(f"ttl_seconds: finite and >= 0 (0: no expiry), got {request.ttl_seconds}")
        expires = time.time() + request.ttl_seconds if request.ttl_seconds else 0.0
        if request.aggregation_id:
            scope = self.registry.scope(request.aggregation_id)
            if scope is None:
                raise NotFound(f"no aggregation {request.aggregation_id!r}")
            token = ClientToken(role, client_id, aggregation_id=request.aggregation_id, created=scope[0],
                                expires=expires)
        else:
            token = ClientToken(role, client_id, ledger_id=codec.ledger_id(request.ledger_id), expires=expires)
        return pb.ClientToken(token=self.client_tokens.issue(token), client_id=client_id,
                              aggregation_id=token.aggregation_id, ledger_id=token.ledger_id, role=request.role,
                              expires_unix_seconds=expires)

    @_status_on_error
    def GetLedger(self, request: pb.GetLedgerRequest, context) -> pb.Ledger:
        ledger = self.lifecycle.ledgers.describe(request.ledger_id)
        if ledger is None:
            raise NotFound(f"no ledger {request.ledger_id!r}")
        return codec.ledger_to_proto(ledger)

    @_status_on_error
    def GetPlacement(self, request: pb.GetPlacementRequest, context) -> pb.Placement:
        """Where each shard is summed (the admin, or a holder of the aggregation's submit token)."""
        aggregation = self.check_submitter(bearer_token(context.invocation_metadata()), request.aggregation_id,
                                           "submit to")
        endpoints = self.lifecycle.shards.endpoints()
        return pb.Placement(aggregation_id=aggregation.id, shards=aggregation.shards,
                            endpoints=[endpoints[k % len(endpoints)] for k in range(aggregation.shards)]
                            if endpoints else [])

    # Streaming ----------------------------------------------------------------------
    def Submit(self, request_iterator, context):
        token = bearer_token(context.invocation_metadata())
        session = _SubmitSession(self, token, self.certified_client(context))
        owner = stream_owner(token, context)
        try:
            self.stream_slots.acquire(owner, session)
        except ClipdError as e:
            self.refuse(context, e, "Submit")
        try:
            threading.Thread(target=session.read, args=(request_iterator,), name="clipd-submit-reader",
                             daemon=True).start()
            yield from session.acknowledgements(context)
        finally:
            self.stream_slots.release(owner, session)

    # Resuming a broken stream's batch ---------------------------------------------------------
    def park(self, key: tuple[str, str], writer: str, partial) -> list:
        """Keeps a broken stream's partly received batch for a resuming stream of ``writer`` (see
        SubmitRequest.resume); :meth:`keep_parked` then holds it for ``stream_idle_timeout`` seconds."""
        entry = [writer, partial]
        with self._parked_cond:
            self._drop_parked_locked(key)
            self._parked[key] = entry
            self._parked_cond.notify_all()
        return entry

    def keep_parked(self, key: tuple[str, str], entry: list) -> None:
        """Waits until a resuming stream takes the parked batch, or ``stream_idle_timeout``; then its buffers
        and bytes go. Run by the broken stream's reader thread (the stream itself has ended)."""
        with self._parked_cond:
            self._parked_cond.wait_for(lambda: entry[1] is None, self.settings.stream_idle_timeout)
            if self._parked.get(key) is entry:
                del self._parked[key]
            left, entry[1] = entry[1], None
        if left is not None and left.reservation is not None:
            left.reservation.give_back(reuse=False)

    def unpark(self, key: tuple[str, str], writer: str, resume: bool, still_open=lambda: False):
        """The batch a broken stream of ``writer`` left for this client, if ``resume``; any other is dropped.

        A resuming stream may come before the server has seen its old stream break: while ``still_open()``
        (another stream of the writer is attached) it waits for that one to end, a few seconds at most."""
        deadline = time.monotonic() + min(RESUME_WAIT, self.settings.stream_idle_timeout)
        with self._parked_cond:
            while (resume and writer and key not in self._parked and still_open()
                   and (left := deadline - time.monotonic()) > 0):
                self._parked_cond.wait(min(left, 0.05))
            entry = self._parked.get(key)
            if entry is None:
                return None
            if resume and entry[0] == writer and writer:
                del self._parked[key]
                partial, entry[1] = entry[1], None
                self._parked_cond.notify_all()
                return partial
            self._drop_parked_locked(key)
            return None

    def _drop_parked_locked(self, key) -> None:
        entry = self._parked.pop(key, None)
        if entry is not None:
            partial, entry[1] = entry[1], None
            self._parked_cond.notify_all()
            if partial is not None and partial.reservation is not None:
                partial.reservation.give_back(reuse=False)

    def is_admin(self, token: str | None) -> bool:
        """Auth off, or the admin token."""
        return not self.settings.admin_token or same(token, self.settings.admin_token)

    def check_submitter(self, token: str | None, aggregation_id: str, action: str) -> Aggregation:
        """The aggregation, if ``token`` may submit to it (see :meth:`authorize`)."""
        self.authorize(token, aggregation_id, action)
        return self.registry.get(aggregation_id)  # a finalized one refuses batches there, as for the admin

    def authorize(self, token: str | None, aggregation_id: str, action: str) -> None:
        """Refuses unless ``token`` is the admin's, the submit token of ``aggregation_id``, or a client token
        whose scope covers it.

        No token, or one that is no credential of this server (or an expired client token): UNAUTHENTICATED.
        A submit token of another aggregation, a client token for another aggregation or ledger:
        PERMISSION_DENIED (as for an unknown id, so ids do not leak to holders of other tokens).
        """
        scope = self.registry.scope(aggregation_id) if token is not None else None
        if self.may_submit(token, aggregation_id, scope):
            return
        client = self.client_tokens.read(token)
        if client is not None and client.expires and client.expires <= time.time():
            expired = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(client.expires))
            raise Unauthenticated(f"this client token expired at {expired}; ask the admin for a new one")
        if token is None or not self.is_credential(token):
            raise Unauthenticated("a valid 'authorization: Bearer <token>' is required")
        raise PermissionDenied(f"this token may not {action} aggregation {aggregation_id!r}")

    def may_submit(self, token: str | None, aggregation_id: str, scope: tuple[float, str | None] | None) -> bool:
        """The admin token, the submit token of ``aggregation_id``, or a client token that covers it (``scope``:
        its creation time and ledger, ``Registry.scope``; None: unknown)."""
        if self.is_admin(token):
            return True
        if token is None or scope is None:
            return False
        created, ledger = scope
        if self.submit_tokens.check(token, aggregation_id, created):
            return True
        client = self.client_tokens.read(token)
        return client is not None and client.covers(aggregation_id, created, ledger)

    def is_credential(self, token: str) -> bool:
        """The admin token, a client token of this server, or the submit token of some aggregation of it."""
        return self.is_admin(token) or self.client_tokens.read(token) is not None or any(
            self.submit_tokens.check(token, i, created) for i, created in self.registry.identities())

    # Who a client is ------------------------------------------------------------------------------
    def certified_client(self, context) -> str | None:
        """The client id of the caller's client certificate (mutual TLS: its Common Name), as this process's
        TLS verified it or, on a call another clipd process forwarded, as that one vouched for it."""
        for key, value in context.invocation_metadata() or ():
            if key == CERTIFIED_CLIENT_METADATA:
                return self.client_tokens.vouched(value)
        return certificate_client_id(context) if self.settings.tls_client_ca_file else None

    def credential_client_id(self, token: str | None, context) -> str | None:
        """The client id a stream's credential names, if any: its client token's, else its certificate's."""
        client = self.client_tokens.read(token)
        if client is not None and client.role == CLIENT:
            return client.client_id
        return self.certified_client(context)

    def client_identity(self, token: str | None, certified: str | None, aggregation: Aggregation, named: str) -> str:
        """The client id a Submit stream is counted under (docs/threat-model.md).

        A client token's (the stream may name it, one of its spread ids, or nothing); the named one for a trusted
        submitter (the admin, a submitter token, or anyone on a server without auth) and wherever identities do
        not count; on an aggregation that counts them (unit CLIENT, or a correlated stream's enforced
        participation), the client certificate's (named, or not named), else the named one only if the
        aggregation takes self-asserted ids. Anything else is PERMISSION_DENIED, saying which credential to use.
        """
        client = self.client_tokens.read(token)
        if client is not None and client.role == CLIENT:
            return _as_credential(client.client_id, named, "this client token")
        if self.is_admin(token) or (client is not None and client.role == SUBMITTER) \
                or not aggregation.counts_identities:
            return check_client_id(named)
        if certified is not None and (aggregation.client_ids != SELF_ASSERTED or not named
                                      or client_of(named) == certified):
            if not codec.ID_PATTERN.match(certified):
                raise PermissionDenied(f"the client certificate's Common Name {certified[:64]!r} is not a client id"
                                       " (1-128 letters, digits, '-', '_' or '.')")
            return _as_credential(certified, named, "the client certificate")
        if aggregation.client_ids == SELF_ASSERTED:
            return check_client_id(named)
        raise PermissionDenied(
            f"aggregation {aggregation.id} counts client identities ({_why_identities(aggregation)}), so a client id"
            " comes from a credential: submit with a client token (the admin issues one: IssueClientToken,"
            " `clipd token`), or with a client certificate (mutual TLS); its submit token may not name client ids"
            " unless it was created with self_asserted_client_ids")


PEER_METADATA = "x-clipd-peer"  # a forwarded call's own peer (its fair share of stream slots)


def stream_owner(token: str | None, context) -> tuple[str, str]:
    """Whom a stream speaks for, for the fair share of stream slots: its credential and its peer's host.

    A stream forwarded by a shard process carries the original peer (``x-clipd-peer``, set by clipd only:
    it is trusted on the private socket alone, where nothing else can connect).
    """
    peer = context.peer() or ""
    if peer.startswith("unix:"):
        peer = dict(context.invocation_metadata() or ()).get(PEER_METADATA, peer)
    host = peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return token or "", host


@dataclasses.dataclass(frozen=True)
class _Bound:
    """The reader bound the stream to its aggregation and client: the hello's answer is due."""

    aggregation: Aggregation
    greeting: pb.SubmitResponse


@dataclasses.dataclass(frozen=True)
class _Acknowledged:
    """From the aggregation: the client's durable sequence moved to ``durable`` (None: its state changed)."""

    durable: int | None


@dataclasses.dataclass(frozen=True)
class _Ended:
    """The reader is done: the request stream ended after batch ``last_sequence`` (``error`` None: cleanly)."""

    last_sequence: int
    error: Exception | None


class _Evicted:
    """The stream's slot went to a client of another owner (StreamSlots)."""


EVICTED = Unavailable("this stream's slot went to another client (every slot was taken and this credential held"
                      " the most); reconnect to go on (unacknowledged batches must be sent again)")


class _SubmitSession:
    """One Submit stream: a reader thread takes batches in; the response side acknowledges them.

    Read in one direction: the reader, the aggregation and the stream slots put events (:class:`_Bound`,
    :class:`_Acknowledged`, :class:`_Ended`, :class:`_Evicted`) on :attr:`events`, which the response side
    (:meth:`acknowledgements`) alone takes from; its idle timeout is the wait on that queue. Besides, the
    reader alone writes how far it got (``last_heard``, ``last_sequence``, ``receiving``, ``received_bytes``),
    which the response side reads for its progress messages and idle timeout.
    """

    def __init__(self, servicer: ClipdServicer, token: str | None, certified: str | None = None) -> None:
        self.servicer = servicer
        self.token = token
        self.certified = certified  # the client id of the caller's client certificate (mutual TLS), if any
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.client = ""  # the client id the stream is counted under (ClipdServicer.client_identity)
        self.named = ""  # the client id its messages name ("": the credential's)
        self.writer = ""
        # Written by the reader only.
        self.last_sequence = 0  # the highest sequence this stream delivered whole
        self.receiving = False  # a batch of this stream is partly received (the server waits for its rest)
        self.received_bytes = 0  # tensor bytes received on this stream (progress)
        # When the client was last heard (or, by the response side, last answered): the idle timeout counts from
        # there, and only while the server waits for the client (not while it sums or checkpoints what it sent).
        self.last_heard = time.monotonic()
        self.assembler: BatchAssembler | None = None

    def idle_since(self) -> float:
        return self.last_heard

    def evict(self) -> None:
        """Ends this stream soon (UNAVAILABLE): its slot goes to another owner's client."""
        self.events.put(_Evicted())

    # The reader thread -----------------------------------------------------------------------------
    def read(self, requests) -> None:
        settings = self.servicer.settings
        aggregation: Aggregation | None = None
        assembler = None
        error: Exception | None = None
        broken = False  # the stream ended inside a batch (its received part may be resumed)
        try:
            for message in requests:
                self.last_heard = time.monotonic()
                if isinstance(message, Malformed):
                    raise InvalidArgument(f"malformed SubmitRequest: {message.reason}")
                if aggregation is None:
                    named = self.servicer.check_submitter(self.token, message.aggregation_id, "submit to")
                    assembler = self.assembler = BatchAssembler(
                        named.layers, settings.max_batch_bytes, self.servicer.budget,
                        settings.buffer_wait, large_bytes=settings.max_message_bytes,
                        large_wait=settings.stream_idle_timeout * 0.9)
                    aggregation = self._bind(message, named, assembler)
                    del named
                    if message.sequence == 0 and not message.chunks:
                        continue  # a hello: answered by the response side
                elif message.aggregation_id != aggregation.id or message.client_id not in (self.named, self.client):
                    raise InvalidArgument("a stream carries one aggregation and one client_id")
                if message.sequence < 1:
                    raise InvalidArgument(f"sequence must be >= 1, got {message.sequence}")
                aggregation.check_contribution(self.client, message.sequence)  # (before its bytes are read)
                assert assembler is not None  # (made with the aggregation, at the first message)
                self._set_receiving(aggregation, True)
                self.received_bytes += sum(len(chunk.data) for chunk in message.chunks)
                batch = assembler.add(message.sequence, message.chunks)
                self.last_heard = time.monotonic()  # (add may have waited for memory: not the client's silence)
                del message  # a zero-copy batch keeps its message alive: nothing else may
                if batch is None:
                    continue
                self._set_receiving(aggregation, False)
                self._take(aggregation, batch)
                self.last_sequence = batch.sequence
                del batch
            if assembler is not None and assembler.incomplete_sequence is not None:
                broken = True
                raise InvalidArgument(f"the stream ended inside batch {assembler.incomplete_sequence}")
        except Exception as e:  # ClipdError, or the stream broke (client gone)
            error = e.with_traceback(None)  # the traceback would hold this frame's buffers
        finally:
            self._end(aggregation, assembler, error, broken)

    def _end(self, aggregation: Aggregation | None, assembler: BatchAssembler | None, error: Exception | None,
             broken: bool) -> None:
        """The request stream is over: keeps a large batch it broke inside for a resuming stream, detaches,
        tells the response side."""
        partial = None
        if assembler is not None:
            if (self.writer and (broken or not isinstance(error, ClipdError))
                    and assembler.incomplete_bytes >= RESUME_MIN_BYTES):
                partial = assembler.take_partial()  # the connection broke inside a large batch: kept a while
            assembler.discard()
        parked = None
        if aggregation is not None:
            self._set_receiving(aggregation, False)
            if partial is not None:  # (before the detach: a resuming stream that came first waits for it)
                parked = self.servicer.park((aggregation.id, self.client), self.writer, partial)
            aggregation.detach(self.client, self.writer)
        self.events.put(_Ended(self.last_sequence, error))
        if parked is not None and aggregation is not None:
            self.servicer.keep_parked((aggregation.id, self.client), parked)

    def _take(self, aggregation: Aggregation, batch) -> None:
        """Hands a whole batch on to the aggregation's lifecycle (which may let go of it: a duplicate)."""
        self.servicer.payload_bytes += batch.nbytes  # one reader thread per stream: a rare lost += is harmless
        self.servicer.lifecycle.submit(aggregation, self.client, self.writer, batch)

    def _bind(self, message, aggregation: Aggregation, assembler: BatchAssembler) -> Aggregation:
        """The stream's first message names its aggregation (checked: who may submit) and client: attach."""
        self.named = message.client_id
        self.client = self.servicer.client_identity(self.token, self.certified, aggregation, message.client_id)
        if aggregation.unit is Unit.CLIENT and wire.SPREAD_MARK in self.client:
            raise InvalidArgument(f"client_id {self.client!r}: under unit client a client contributes one batch, so"
                                  " its submission is not spread over streams (send it as one client)")
        self.writer = message.writer_id
        self.servicer.lifecycle.check_participation(aggregation, self.client)
        durable, accepted, last_writer = aggregation.attach(self.client, self.writer)
        greeting = pb.SubmitResponse(acknowledged_sequence=durable, accepted_sequence=accepted,
                                     aggregation_examples=aggregation.examples, writer_id=last_writer,
                                     client_id=self.client)
        hello = message.sequence == 0 and not message.chunks
        partial = self.servicer.unpark((aggregation.id, self.client), self.writer, hello and message.resume,
                                       lambda: aggregation.streams_of(self.client, self.writer) > 1)
        if partial is not None:  # the rest of that batch comes on this stream
            assembler.adopt(partial)
            greeting.partial_sequence = partial.sequence
            greeting.partial_bytes.extend(partial.received)
            self._set_receiving(aggregation, True)
        self.events.put(_Bound(aggregation, greeting))
        return aggregation

    def _set_receiving(self, aggregation: Aggregation, receiving: bool) -> None:
        """A batch of this stream starts or stops arriving (the aggregation counts them per shard: a large
        checkpoint waits a little for one about to complete, to cover both)."""
        if receiving != self.receiving:
            aggregation.batch_arriving(self.client, 1 if receiving else -1)
        self.receiving = receiving

    # The response side -----------------------------------------------------------------------------
    def _next_event(self):
        """The next event, or None once the idle timeout's next check (or a progress message) is due."""
        left = self.servicer.settings.stream_idle_timeout - (time.monotonic() - self.last_heard)
        try:
            return self.events.get(timeout=max(0.01, min(PROGRESS_PERIOD, left)) if left > 0 else PROGRESS_PERIOD)
        except queue.Empty:
            return None

    def _idle_error(self, ended: _Ended | None, acknowledged: int) -> Exception | None:
        """UNAVAILABLE if the client has sent nothing for the idle timeout while the server waited for it."""
        timeout = self.servicer.settings.stream_idle_timeout
        if ended is not None or time.monotonic() - self.last_heard < timeout:
            return None
        if self.last_sequence > acknowledged and not self.receiving:
            return None  # the client waits for the server (its batches are being summed or checkpointed)
        if self.assembler is not None and self.assembler.waiting_for_room:
            return None  # the server waits for memory to take the client's update in
        return Unavailable(f"nothing received for {timeout:g} s: the stream is closed;"
                           " reconnect to go on (unacknowledged batches must be sent again)")

    def acknowledgements(self, context) -> Iterator[pb.SubmitResponse]:
        """Yields the hello's answer, then an acknowledgement whenever this client's durable sequence moves;
        ends with the stream's error, if any."""
        error: Exception | None = None
        ended: _Ended | None = None
        bound: _Bound | None = None
        while bound is None and ended is None and error is None:
            event = self._next_event()
            if isinstance(event, _Bound):
                bound = event
            elif isinstance(event, _Ended):
                ended, error = event, event.error
            elif isinstance(event, _Evicted):
                error = EVICTED
            elif not context.is_active():
                return
            else:
                error = self._idle_error(ended, 0)
        if bound is not None and error is None:
            yield bound.greeting
            aggregation = bound.aggregation
            listener = self._acknowledged
            aggregation.listen(self.client, listener)  # its first read below sees any earlier change
            try:
                error = yield from self._acknowledge(aggregation, bound.greeting.acknowledged_sequence, context)
            finally:
                aggregation.unlisten(self.client, listener)
            if error is _GONE:
                return
        if isinstance(error, ClipdError):
            self.servicer.refuse(context, error, "Submit")
        elif error is not None and context.is_active():
            context.abort(grpc.StatusCode.CANCELLED, f"the request stream broke: {error}")

    def _acknowledged(self, durable: int | None) -> None:
        """The aggregation's listener (called under its lock: a put never blocks)."""
        self.events.put(_Acknowledged(durable))

    def _acknowledge(self, aggregation: Aggregation, sent: int,
                     context) -> Generator[pb.SubmitResponse, None, Exception | None]:
        """Acknowledges each move of the client's durable sequence until the stream's batches are all durable
        or it ended otherwise; returns the error to end with (None, or ``_GONE`` if the client went away).
        While the server holds batches of this stream not yet acknowledged, a progress message goes out every
        ``PROGRESS_PERIOD``."""
        ended: _Ended | None = None
        last_said = time.monotonic()
        with aggregation.cond:
            done, state = aggregation.durable(self.client), aggregation.state
        while True:
            now = time.monotonic()
            if done > sent:
                sent = done
                self.last_heard = last_said = now  # the client's turn again: its silence counts from here
                yield pb.SubmitResponse(acknowledged_sequence=done, aggregation_examples=aggregation.examples)
            elif ((self.receiving or self.last_sequence > done) and ended is None
                  and now - last_said >= PROGRESS_PERIOD):
                last_said = now  # a large update in the works: say how far it is
                yield pb.SubmitResponse(acknowledged_sequence=done, aggregation_examples=aggregation.examples,
                                        received_bytes=self.received_bytes,
                                        summed_sequence=aggregation.summed(self.client))
            if ended is not None and (ended.error is not None or done >= ended.last_sequence):
                return ended.error
            if state is State.CANCELLED:
                return (ended and ended.error) or FailedPrecondition(f"aggregation {aggregation.id} was cancelled")
            if state is State.FAILED:
                return FailedPrecondition(f"aggregation {aggregation.id} failed: {aggregation.failure_reason}")
            if not context.is_active():
                return _GONE
            if (idle := self._idle_error(ended, sent)) is not None:
                return idle
            event = self._next_event()
            if isinstance(event, _Acknowledged):
                if event.durable is None:
                    state = aggregation.state
                else:
                    done = max(done, event.durable)
            elif isinstance(event, _Ended):
                ended = event
            elif isinstance(event, _Evicted):
                return EVICTED


_GONE = Exception("the client went away")  # (a sentinel: nothing is sent to a client that is gone)


def check_limits(layers, settings: Settings) -> None:
    """Refuses an aggregation spec beyond the server's limits (layers, name lengths, parameters)."""
    if len(layers) > settings.max_layers:
        raise InvalidArgument(f"layers: at most {settings.max_layers}, got {len(layers)}")
    for layer in layers:
        if len(layer.name) > settings.max_name_length:
            raise InvalidArgument(f"layer {layer.name[:32]!r}...: names have at most {settings.max_name_length}"
                                  f" characters, got {len(layer.name)}")
    parameters = sum(math.prod(layer.shape) for layer in layers)
    if parameters > settings.parameter_limit:
        derived = "" if settings.max_parameters else f", what the memory budget of {settings.memory} bytes holds"
        raise InvalidArgument(f"the layers hold {parameters} parameters, the limit is {settings.parameter_limit}"
                              f" (max_parameters{derived})")
