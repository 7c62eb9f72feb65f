"""The gRPC servicer: thin methods over plain handlers; ClipdError becomes a status in one place.

Request path of a batch: ``Submit`` (a reader thread per stream) ->
``BatchAssembler.add`` (chunks checked and reassembled) -> ``_check_finite``
(policy REJECT only) -> ``Aggregation.accept`` (sequence numbers, duplicates)
-> ``DeviceWorker.submit`` (bounded queue) -> worker step -> the accumulator's
device delta -> a flush into the host totals -> a checkpoint committed to the
store -> ``Aggregation.mark_durable``. The stream acknowledges durable batches only.
"""

from __future__ import annotations

import functools
import threading

import grpc
import numpy as np

from clipd.v1 import clipd_pb2 as pb
from clipd.v1 import clipd_pb2_grpc as pb_grpc

from . import codec
from .aggregations import Aggregation, Registry, Result, State
from .batches import BatchAssembler
from .errors import AlreadyExists, ClipdError, FailedPrecondition, InvalidArgument
from .settings import Settings
from .store import AggregationRecord, Store
from .worker import DeviceWorker


def _status_on_error(method):
    """Maps a ClipdError raised by a handler to its gRPC status."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except ClipdError as e:
            self.rejected(e.code)
            context.abort(e.code, str(e))

    return wrapper


def _check_id(value: str, what: str) -> str:
    if not codec.ID_PATTERN.match(value):
        raise InvalidArgument(f"{what}: 1-128 letters, digits, '-', '_' or '.', got {value!r}")
    return value


class ClipdServicer(pb_grpc.ClipdServicer):
    def __init__(self, settings: Settings, registry: Registry, worker: DeviceWorker, store: Store) -> None:
        self.settings = settings
        self.registry = registry
        self.worker = worker
        self.store = store
        self.rejections: dict[str, int] = {}
        self.active_streams = 0
        self._lock = threading.Lock()

    def rejected(self, code: grpc.StatusCode) -> None:
        with self._lock:
            self.rejections[code.name] = self.rejections.get(code.name, 0) + 1

    # Aggregations -----------------------------------------------------------------------
    @_status_on_error
    def CreateAggregation(self, request: pb.CreateAggregationRequest, context) -> pb.Aggregation:
        layers = codec.layers_from_proto(request.layers)
        policy, reject = codec.policy_from_proto(request.policy, len(layers))
        requested = _check_id(request.aggregation_id, "aggregation_id") if request.aggregation_id else ""

        def make(aggregation_id: str) -> Aggregation:
            return Aggregation(aggregation_id, layers, policy, reject,
                               self.settings.max_device_rows, self.settings.staging_bytes)

        def publish(aggregation: Aggregation) -> None:  # durable before anyone can see it
            record = AggregationRecord(aggregation.id, codec.spec_to_json(layers, policy, reject),
                                       created=aggregation.created)
            if not self.store.create(record):
                raise AlreadyExists(f"aggregation {aggregation.id!r} exists in the store")
            self.worker.warm_up(aggregation)

        aggregation, created = self.registry.create(requested, make, publish)
        if not created and (aggregation.layers, aggregation.policy, aggregation.reject_non_finite) != (
                layers, policy, reject):
            raise AlreadyExists(f"aggregation {aggregation.id!r} exists with another spec or policy")
        return self._describe(aggregation)

    @_status_on_error
    def GetAggregation(self, request: pb.GetAggregationRequest, context) -> pb.Aggregation:
        return self._describe(self.registry.get(request.aggregation_id))

    @_status_on_error
    def ListAggregations(self, request, context) -> pb.ListAggregationsResponse:
        return pb.ListAggregationsResponse(aggregations=[self._describe(a) for a in self.registry.all()])

    @_status_on_error
    def CancelAggregation(self, request: pb.CancelAggregationRequest, context) -> pb.Aggregation:
        return self._describe(self.cancel(request.aggregation_id))

    def cancel(self, aggregation_id: str) -> Aggregation:
        """Drops an aggregation (or a finished one's result): queued batches, device state, store."""
        aggregation = self.registry.remove(aggregation_id)
        aggregation.cancel()
        self.worker.forget(aggregation)
        self.store.delete(aggregation.id)
        return aggregation

    @_status_on_error
    def GetStats(self, request: pb.GetStatsRequest, context) -> pb.AggregationStats:
        return codec.stats_to_proto(self.registry.get(request.aggregation_id).stats())

    def Finalize(self, request: pb.FinalizeRequest, context):
        try:
            result = self.finalize(request.aggregation_id)
        except ClipdError as e:
            self.rejected(e.code)
            context.abort(e.code, str(e))
        limit = min(request.max_chunk_bytes or self.settings.max_message_bytes, self.settings.max_message_bytes)
        yield pb.FinalizeResponse(stats=codec.stats_to_proto(result.stats))
        for k, total in enumerate(result.sums):
            for chunk in codec.tensor_chunks(k, total, max(1, limit - 1024)):
                yield pb.FinalizeResponse(sum=chunk)

    def finalize(self, aggregation_id: str) -> Result:
        """Closes the aggregation, waits for its last batch, commits and keeps the result (idempotent)."""
        aggregation = self.registry.get(aggregation_id)
        timeout = self.settings.finalize_timeout
        return aggregation.finalize(lambda: self.worker.commit_final(aggregation, timeout), timeout)

    def _describe(self, aggregation: Aggregation) -> pb.Aggregation:
        return pb.Aggregation(
            aggregation_id=aggregation.id,
            layers=codec.layers_to_proto(aggregation.layers),
            policy=codec.policy_to_proto(aggregation.policy, aggregation.reject_non_finite),
            state=codec.STATES[aggregation.state],
            layer_bounds=aggregation.accumulator.bounds,
            examples=aggregation.examples,
            created_unix_seconds=aggregation.created,
            failure_reason=aggregation.failure_reason,
        )

    # Streaming ----------------------------------------------------------------------
    def Submit(self, request_iterator, context):
        session = _SubmitSession(self)
        reader = threading.Thread(target=session.read, args=(request_iterator,), daemon=True)
        with self._lock:
            self.active_streams += 1
        try:
            reader.start()
            yield from session.acknowledgements(context)
        finally:
            with self._lock:
                self.active_streams -= 1


class _SubmitSession:
    """One Submit stream: a reader thread takes batches in, the response side acknowledges them."""

    def __init__(self, servicer: ClipdServicer) -> None:
        self.servicer = servicer
        self.bound = threading.Event()
        self.aggregation: Aggregation | None = None
        self.client = ""
        self.writer = ""
        self.greeting: pb.SubmitResponse | None = None  # the answer to a hello, until sent
        self.last_sequence = 0  # the highest sequence this stream delivered whole
        self.finished = False
        self.error: Exception | None = None

    def read(self, requests) -> None:
        assembler = None
        try:
            for message in requests:
                if self.aggregation is None:
                    self._bind(message)
                    assembler = BatchAssembler(self.aggregation.layers, self.servicer.settings.max_batch_bytes)
                    if message.sequence == 0 and not message.chunks:
                        continue  # a hello: answered by the response side
                elif (message.aggregation_id, message.client_id) != (self.aggregation.id, self.client):
                    raise InvalidArgument("a stream carries one aggregation and one client_id")
                if message.sequence < 1:
                    raise InvalidArgument(f"sequence must be >= 1, got {message.sequence}")
                batch = assembler.add(message.sequence, message.chunks)
                if batch is None:
                    continue
                if self.aggregation.reject_non_finite:
                    _check_finite(batch, self.aggregation)
                if self.aggregation.accept(self.client, batch.sequence, self.writer):
                    try:
                        self.servicer.worker.submit(self.aggregation, self.client, self.writer, batch)
                    except ClipdError:
                        self.aggregation.drop(1)
                        raise
                self.last_sequence = batch.sequence
            if assembler is not None and assembler.incomplete_sequence is not None:
                raise InvalidArgument(f"the stream ended inside batch {assembler.incomplete_sequence}")
        except Exception as e:  # ClipdError, or the stream broke (client gone)
            self.error = e
        finally:
            self.finished = True
            self.bound.set()
            if self.aggregation is not None:
                self.aggregation.detach(self.client, self.writer)  # wakes the response side too

    def _bind(self, message) -> None:
        aggregation = self.servicer.registry.get(message.aggregation_id)
        self.client = _check_id(message.client_id, "client_id")
        self.writer = message.writer_id
        durable, accepted, last_writer = aggregation.attach(self.client, self.writer)
        self.greeting = pb.SubmitResponse(acknowledged_sequence=durable, accepted_sequence=accepted,
                                          aggregation_examples=aggregation.examples, writer_id=last_writer)
        self.aggregation = aggregation
        self.bound.set()

    def acknowledgements(self, context):
        """Yields the hello's answer, then an acknowledgement whenever this client's durable sequence moves."""
        while not self.bound.wait(timeout=1.0):
            if not context.is_active():
                return
        aggregation = self.aggregation
        sent = 0
        if aggregation is not None and self.greeting is not None:
            sent = self.greeting.acknowledged_sequence
            yield self.greeting
        ended = (State.CANCELLED, State.FAILED)
        while aggregation is not None:
            with aggregation.cond:
                aggregation.cond.wait_for(
                    lambda: aggregation.durable(self.client) > sent
                    or (self.finished and (self.error is not None
                                           or aggregation.durable(self.client) >= self.last_sequence))
                    or aggregation.state in ended,
                    timeout=1.0,
                )
                done = aggregation.durable(self.client)
                examples = aggregation.examples
                state = aggregation.state
            if done > sent:
                sent = done
                yield pb.SubmitResponse(acknowledged_sequence=done, aggregation_examples=examples)
            if self.finished and (self.error is not None or done >= self.last_sequence):
                break
            if state is State.CANCELLED:
                self.error = self.error or FailedPrecondition(f"aggregation {aggregation.id} was cancelled")
                break
            if state is State.FAILED:
                self.error = FailedPrecondition(f"aggregation {aggregation.id} failed: {aggregation.failure_reason}")
                break
            if not context.is_active():
                return
        if isinstance(self.error, ClipdError):
            self.servicer.rejected(self.error.code)
            context.abort(self.error.code, str(self.error))
        elif self.error is not None and context.is_active():
            context.abort(grpc.StatusCode.CANCELLED, f"the request stream broke: {self.error}")


def _check_finite(batch, aggregation: Aggregation) -> None:
    for layer, values in zip(aggregation.layers, batch.layers):
        finite = np.isfinite(values.reshape(batch.rows, -1)).all(axis=1)
        if not finite.all():
            row = int(np.argmin(finite))
            raise InvalidArgument(
                f"batch {batch.sequence}, layer {layer.name!r}: example {row} holds NaN or inf,"
                " and the policy rejects non-finite values"
            )
