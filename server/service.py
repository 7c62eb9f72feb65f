"""The gRPC servicer: thin methods over plain handlers; ClipdError becomes a status in one place.

Request path of a batch: ``Submit`` (a reader thread per stream) ->
``BatchAssembler.add`` (chunks checked and reassembled) -> ``_check_finite``
(policy REJECT only) -> ``Aggregation.accept`` (sequence numbers, duplicates)
-> ``DeviceWorker.submit`` (bounded queue) -> worker step -> the accumulator.
The stream's responses acknowledge what ``Aggregation.record`` marked summed.
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
    def __init__(self, settings: Settings, registry: Registry, worker: DeviceWorker) -> None:
        self.settings = settings
        self.registry = registry
        self.worker = worker
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

        aggregation, created = self.registry.create(requested, make)
        if created:
            self.worker.warm_up(aggregation)
        elif (aggregation.layers, aggregation.policy, aggregation.reject_non_finite) != (layers, policy, reject):
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
        """Drops an aggregation, its queued batches and its device state (gRPC and admin API)."""
        aggregation = self.registry.remove(aggregation_id)
        aggregation.cancel()
        self.worker.forget(aggregation)
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
        """Closes the aggregation, waits for its last batch, and keeps the result (idempotent)."""
        aggregation = self.registry.get(aggregation_id)

        def read_state():
            state = self.worker.read(aggregation)
            self.worker.forget(aggregation)
            return state

        return aggregation.finalize(read_state)

    def _describe(self, aggregation: Aggregation) -> pb.Aggregation:
        return pb.Aggregation(
            aggregation_id=aggregation.id,
            layers=codec.layers_to_proto(aggregation.layers),
            policy=codec.policy_to_proto(aggregation.policy, aggregation.reject_non_finite),
            state=codec.STATES[aggregation.state],
            layer_bounds=aggregation.accumulator.bounds,
            examples=aggregation.stats().examples,
            created_unix_seconds=aggregation.created,
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
                elif (message.aggregation_id, message.client_id) != (self.aggregation.id, self.client):
                    raise InvalidArgument("a stream carries one aggregation and one client_id")
                if message.sequence < 1:
                    raise InvalidArgument(f"sequence must be >= 1, got {message.sequence}")
                batch = assembler.add(message.sequence, message.chunks)
                if batch is None:
                    continue
                if self.aggregation.reject_non_finite:
                    _check_finite(batch, self.aggregation)
                if self.aggregation.accept(self.client, batch.sequence):
                    try:
                        self.servicer.worker.submit(self.aggregation, self.client, batch)
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
                with self.aggregation.cond:
                    self.aggregation.cond.notify_all()

    def _bind(self, message: pb.SubmitRequest) -> None:
        aggregation = self.servicer.registry.get(message.aggregation_id)
        self.client = _check_id(message.client_id, "client_id")
        self.aggregation = aggregation
        self.bound.set()

    def acknowledgements(self, context):
        """Yields an acknowledgement whenever this client's summed sequence moves; ends with the stream."""
        while not self.bound.wait(timeout=1.0):
            if not context.is_active():
                return
        sent = 0
        aggregation = self.aggregation
        while aggregation is not None:
            with aggregation.cond:
                aggregation.cond.wait_for(
                    lambda: aggregation.accumulated(self.client) > sent
                    or (self.finished and (self.error is not None
                                           or aggregation.accumulated(self.client) >= self.last_sequence))
                    or aggregation.state is State.CANCELLED,
                    timeout=1.0,
                )
                done = aggregation.accumulated(self.client)
                examples = aggregation.examples
            if done > sent:
                sent = done
                yield pb.SubmitResponse(acknowledged_sequence=done, aggregation_examples=examples)
            if self.finished and (self.error is not None or done >= self.last_sequence):
                break
            if aggregation.state is State.CANCELLED:
                self.error = self.error or FailedPrecondition(f"aggregation {aggregation.id} was cancelled")
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
