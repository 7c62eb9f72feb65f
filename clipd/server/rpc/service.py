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
from clipd.server.aggregations import Aggregation, State
from clipd.server.credentials import SubmitTokens, bearer_token, same
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
        return self._describe(self.lifecycle.create(requested, layers, policy, reject, privacy))

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
                              privacy=codec.privacy_to_proto(aggregation.privacy) if aggregation.privacy else None)

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
        )

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
        session = _SubmitSession(self, token)
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
        """The aggregation, if ``token`` is the admin's or its submit token (see :meth:`authorize`)."""
        self.authorize(token, aggregation_id, action)
        return self.registry.get(aggregation_id)  # a finalized one refuses batches there, as for the admin

    def authorize(self, token: str | None, aggregation_id: str, action: str) -> None:
        """Refuses unless ``token`` is the admin's or the submit token of ``aggregation_id``.

        No token, or one that is no credential of this server: UNAUTHENTICATED.
        A submit token of another aggregation: PERMISSION_DENIED (as for an
        unknown id, so ids do not leak to holders of other tokens).
        """
        created = self.registry.created(aggregation_id) if token is not None else None
        if self.may_submit(token, aggregation_id, created):
            return
        if token is None or not self.is_credential(token):
            raise Unauthenticated("a valid 'authorization: Bearer <token>' is required")
        raise PermissionDenied(f"this token may not {action} aggregation {aggregation_id!r}")

    def may_submit(self, token: str | None, aggregation_id: str, created: float | None) -> bool:
        """The admin token, or the submit token of ``aggregation_id`` (created at ``created``; None: unknown)."""
        return self.is_admin(token) or (token is not None and created is not None
                                        and self.submit_tokens.check(token, aggregation_id, created))

    def is_credential(self, token: str) -> bool:
        """The admin token or the submit token of some aggregation of this server."""
        return self.is_admin(token) or any(
            self.submit_tokens.check(token, i, created) for i, created in self.registry.identities())


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

    def __init__(self, servicer: ClipdServicer, token: str | None) -> None:
        self.servicer = servicer
        self.token = token
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.client = ""
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
                elif (message.aggregation_id, message.client_id) != (aggregation.id, self.client):
                    raise InvalidArgument("a stream carries one aggregation and one client_id")
                if message.sequence < 1:
                    raise InvalidArgument(f"sequence must be >= 1, got {message.sequence}")
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
        self.client = check_client_id(message.client_id)
        self.writer = message.writer_id
        self.servicer.lifecycle.check_participation(aggregation, self.client)
        durable, accepted, last_writer = aggregation.attach(self.client, self.writer)
        greeting = pb.SubmitResponse(acknowledged_sequence=durable, accepted_sequence=accepted,
                                     aggregation_examples=aggregation.examples, writer_id=last_writer)
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
