"""One Submit stream on the server: its reader thread takes batches in, its response side acknowledges them; and
a one-message submission (SubmitOne, :func:`submit_one`): the same path for a batch that fits in one message.

Request path of a batch: the stream's reader (``SubmitSession.read``) -> ``BatchAssembler.add`` (chunks checked and
reassembled) -> ``Lifecycle.submit`` (finite? under policy REJECT; ``Aggregation.accept``: sequence numbers,
duplicates; ``Shards.submit``) -> the device worker's step, flush and checkpoint -> ``Aggregation.mark_durable`` ->
the response side's acknowledgement. docs/ARCHITECTURE.md draws it hop by hop.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import grpc

from clipd import wire
from clipd.engine import Unit
from clipd.server.aggregations import Aggregation, State
from clipd.server.errors import Behind, ClipdError, FailedPrecondition, InvalidArgument, Unavailable
from clipd.server.rpc import codec
from clipd.server.rpc.batches import BatchAssembler
from clipd.v1 import clipd_pb2 as pb

RESUME_MIN_BYTES = 256 << 10  # a broken stream's batch is kept for a resuming stream from this much received on
PROGRESS_PERIOD = 0.5  # seconds between progress messages of a stream whose batches the server is working on


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


class SubmitSession:
    """One Submit stream: a reader thread takes batches in; the response side acknowledges them.

    Read in one direction: the reader, the aggregation and the stream slots put events (:class:`_Bound`,
    :class:`_Acknowledged`, :class:`_Ended`, :class:`_Evicted`) on :attr:`events`, which the response side
    (:meth:`acknowledgements`) alone takes from; its idle timeout is the wait on that queue. Besides, the
    reader alone writes how far it got (``last_heard``, ``last_sequence``, ``receiving``, ``received_bytes``),
    which the response side reads for its progress messages and idle timeout.
    """

    def __init__(self, servicer: Any, token: str | None, certified: str | None = None) -> None:
        """``servicer``: the ClipdServicer that opened the stream (its settings, auth, lifecycle, budget, slots,
        parked batches and refusals)."""
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
                if isinstance(message, codec.Malformed):
                    raise InvalidArgument(f"malformed SubmitRequest: {message.reason}")
                if aggregation is None:
                    named = self.servicer.check_submitter(self.token, message.aggregation_id, "submit to")
                    assembler = self.assembler = assembler_for(named, settings, self.servicer.budget)
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
                parked = self.servicer.parked.park((aggregation.id, self.client), self.writer, partial)
            aggregation.detach(self.client, self.writer)
        self.events.put(_Ended(self.last_sequence, error))
        if parked is not None and aggregation is not None:
            self.servicer.parked.keep((aggregation.id, self.client), parked)

    def _take(self, aggregation: Aggregation, batch) -> None:
        """Hands a whole batch on to the aggregation's lifecycle (which may let go of it: a duplicate)."""
        self.servicer.payload_bytes += batch.nbytes  # one reader thread per stream: a rare lost += is harmless
        self.servicer.lifecycle.submit(aggregation, self.client, self.writer, batch)

    def _bind(self, message, aggregation: Aggregation, assembler: BatchAssembler) -> Aggregation:
        """The stream's first message names its aggregation (checked: who may submit) and client: attach."""
        self.named = message.client_id
        self.client = client_of_call(self.servicer, self.token, self.certified, aggregation, message.client_id)
        self.writer = message.writer_id
        durable, accepted, last_writer = aggregation.attach(self.client, self.writer)
        greeting = pb.SubmitResponse(acknowledged_sequence=durable, accepted_sequence=accepted,
                                     aggregation_examples=aggregation.examples, writer_id=last_writer,
                                     client_id=self.client)
        hello = message.sequence == 0 and not message.chunks
        partial = self.servicer.parked.take((aggregation.id, self.client), self.writer, hello and message.resume,
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


def assembler_for(aggregation: Aggregation, settings, budget) -> BatchAssembler:
    """The batch assembler of one Submit stream or SubmitOne call into ``aggregation``: the server's limits, its
    buffer budget; a large update (more than a message) waits as long as a stream may be silent for room, and
    for the aggregation's prepared receive buffers."""
    return BatchAssembler(aggregation.layers, settings.max_batch_bytes, budget, settings.buffer_wait,
                          large_bytes=settings.max_message_bytes, large_wait=settings.stream_idle_timeout * 0.9,
                          warmed=aggregation.wait_warmed)


def client_of_call(servicer: Any, token: str | None, certified: str | None, aggregation: Aggregation,
                   named: str) -> str:
    """The client id a Submit stream or SubmitOne call is counted under (``Authenticator.client_identity``), once
    checked: not a spread id under unit client, let take part in the release (``Lifecycle.check_participation``)."""
    client = servicer.auth.client_identity(token, certified, aggregation, named)
    if aggregation.unit is Unit.CLIENT and wire.SPREAD_MARK in client:
        raise InvalidArgument(f"client_id {client!r}: under unit client a client contributes one batch, so"
                              " its submission is not spread over streams (send it as one client)")
    servicer.lifecycle.check_participation(aggregation, client)
    return client


def submit_one(servicer: Any, message, token: str | None, certified: str | None, context) -> pb.SubmitResponse:
    """SubmitOne: one whole batch in one message, taken in as a stream's batch is and answered once it is durable.

    The same checks, in the same order, as a stream's first message and batch (who may submit, the client's
    identity and participation, the sequence number); the same hand-over (``BatchAssembler.add`` ->
    ``Lifecycle.submit``) and the same acknowledgement (its client's durable sequence: the checkpoint that makes
    it durable is shared by every batch that arrived since the last). No hello: a batch numbered at or below what
    the client has is a duplicate if this writer sent it last (answered once durable), else ``Behind``.
    """
    if isinstance(message, codec.Malformed):
        raise InvalidArgument(f"malformed SubmitRequest: {message.reason}")
    aggregation = servicer.check_submitter(token, message.aggregation_id, "submit to")
    client = client_of_call(servicer, token, certified, aggregation, message.client_id)
    sequence, writer = message.sequence, message.writer_id
    if sequence < 1:
        raise InvalidArgument(f"sequence must be >= 1, got {sequence} (SubmitOne carries a whole batch: no hello)")
    aggregation.check_contribution(client, sequence)
    durable, accepted, last_writer = aggregation.attach(client, writer)
    try:
        if sequence <= accepted and not (sequence == accepted and last_writer == writer):
            raise Behind(f"client {client!r} has batches up to {accepted} (another submission's): number this one"
                         f" {accepted + 1}", accepted)
        if sequence > durable:
            assembler = assembler_for(aggregation, servicer.settings, servicer.budget)
            try:
                batch = assembler.add(sequence, message.chunks)
                if batch is None:
                    raise InvalidArgument(f"batch {sequence}: SubmitOne takes a whole batch in one message (a larger"
                                          " one goes on a Submit stream)")
            finally:
                assembler.discard()  # (a batch that was not whole: its reservation given back)
            del message  # a zero-copy batch keeps its message alive: nothing else may
            servicer.payload_bytes += batch.nbytes
            servicer.lifecycle.submit(aggregation, client, writer, batch)
            del batch
            durable = _durable_after(aggregation, client, sequence, context)
    finally:
        aggregation.detach(client, writer)
    return pb.SubmitResponse(acknowledged_sequence=durable, accepted_sequence=max(accepted, sequence),
                             aggregation_examples=aggregation.examples, client_id=client)


def _durable_after(aggregation: Aggregation, client: str, sequence: int, context) -> int:
    """Waits until ``client``'s batch ``sequence`` is durable: its durable sequence then. The aggregation wakes
    this call alone (a listener of its client); it gives up when the caller is gone or the aggregation ended."""
    woken = threading.Event()

    def listener(durable: int | None) -> None:  # (called under the aggregation's lock: it must not block)
        woken.set()

    aggregation.listen(client, listener)
    try:
        while True:
            durable = aggregation.durable(client)
            if durable >= sequence:
                return durable
            state = aggregation.state
            if state is State.CANCELLED:
                raise FailedPrecondition(f"aggregation {aggregation.id} was cancelled")
            if state is State.FAILED:
                raise FailedPrecondition(f"aggregation {aggregation.id} failed: {aggregation.failure_reason}")
            if not context.is_active():
                raise Unavailable("the client went away before its batch was durable")
            woken.wait(PROGRESS_PERIOD)
            woken.clear()
    finally:
        aggregation.unlisten(client, listener)
