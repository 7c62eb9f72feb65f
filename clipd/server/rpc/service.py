"""The gRPC servicer: thin methods over plain handlers; ClipdError becomes a status in one place.

Who may call: :mod:`clipd.server.rpc.auth` (the guard asks it before a handler runs, a handler for the
aggregation a call names). A Submit stream: :mod:`clipd.server.rpc.submit` (a reader thread per stream ->
``BatchAssembler.add`` -> ``Lifecycle.submit`` -> the device worker's step, flush and checkpoint -> the
durable acknowledgement; docs/ARCHITECTURE.md draws it hop by hop). A broken stream's batch kept for a resume:
:mod:`clipd.server.rpc.resume`. A DP-SGD step in one call (create, submit, finalize): :mod:`clipd.server.rpc.steps`.

Abuse limits on that path: a stream takes one of ``max_streams`` slots (else
RESOURCE_EXHAUSTED with a retry hint); a one-message submission (SubmitOne) waits for one of
``max_streams`` threads of its own, up to ``one_message_queue`` of them (else RESOURCE_EXHAUSTED with
an appointment: ``limits.Admission``); a batch reserves its bytes in the one
buffer budget of the server when its first chunk arrives; a stream that sends
nothing for ``stream_idle_timeout`` seconds is closed (UNAVAILABLE: the client
reconnects and resends what was not acknowledged); a message that does not
parse is INVALID_ARGUMENT. Whatever way a stream ends, its partial batch and
reservation are given back.
"""

from __future__ import annotations

import functools
import logging
import math
import threading

from clipd import wire
from clipd.server.aggregations import Aggregation, refuse_buffer
from clipd.server.credentials import SubmitTokens, bearer_token
from clipd.server.errors import (
    ClipdError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from clipd.server.internal.v1 import shard_host_pb2 as host_pb
from clipd.server.lifecycle import Lifecycle
from clipd.server.logs import event
from clipd.server.rpc import codec, steps
from clipd.server.rpc import streams as stream_rpcs
from clipd.server.rpc.auth import Authenticator, check_id
from clipd.server.rpc.limits import Admission, StreamSlots
from clipd.server.rpc.resume import ParkedBatches
from clipd.server.rpc.submit import SubmitSession, stream_owner, submit_one
from clipd.server.sampling import MAX_CANDIDATES
from clipd.server.settings import Settings
from clipd.server.streams import Streams, iter_releases
from clipd.server.summing.memory import ByteBudget
from clipd.v1 import clipd_pb2 as pb
from clipd.v1 import clipd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
CHUNK_OVERHEAD = 1024  # bytes of a FinalizeResponse besides the tensor data
RECEIVE_BUFFERS = 2  # updates of a large model whose receive buffers are prepared as its aggregation opens
WATCHERS = 16  # WatchReleases streams at once (each holds a server thread while it waits for releases)


def _status_on_error(method):
    """Maps a ClipdError raised by a handler to its gRPC status."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            if isinstance(request, codec.Malformed):
                raise InvalidArgument(f"malformed {method.__name__} request: {request.reason}")
            return method(self, request, context)
        except ClipdError as e:
            self.refuse(context, e, method.__name__)

    return wrapper


class ClipdServicer(pb_grpc.ClipdServicer):
    """Clipd's RPCs: who may call, what the request says (``codec``), then one call on the ``lifecycle``."""

    def __init__(self, settings: Settings, lifecycle: Lifecycle, submit_tokens: SubmitTokens) -> None:
        self.settings = settings
        self.lifecycle = lifecycle
        self.registry = lifecycle.registry
        self.auth = Authenticator(settings.admin_token, self.registry, submit_tokens, bool(settings.tls_client_ca_file))
        self.budget = ByteBudget(settings.max_buffered_bytes or self._memory_left)
        self.stream_slots = StreamSlots(settings.max_streams, "Submit stream")
        self.admission = Admission(settings.max_streams, settings.one_message_queue)  # SubmitOne's own pool
        self.rejections: dict[str, int] = {}  # gRPC status name -> count
        self.payload_bytes = 0  # tensor bytes of the batches that Submit streams delivered to this process
        self._lock = threading.Lock()
        self.parked = ParkedBatches(settings.stream_idle_timeout)  # broken streams' batches, for a resume
        self.streams: Streams | None = None  # the buffered streams, where this process runs them (ClipdServer)
        self.watch_slots = StreamSlots(WATCHERS, "WatchReleases stream")
        self.step_drops = steps.StepDrops(lifecycle)  # earlier DP-SGD steps' aggregations, dropped after the answer

    def _memory_left(self) -> int:
        """The buffer for updates in flight in this process: its share of the memory budget, less the sums of
        the aggregations open here (a shard process holds about its share of each aggregation's shards)."""
        share = max(1, self.settings.processes)
        return max(0, self.settings.memory // share - self.registry.state_bytes() // share)

    def attach_devices(self, devices) -> None:
        """``devices`` (``Devices``, in the process that receives what they sum) learn what this process's calls
        need of them: as an aggregation whose updates span messages warms up, they prepare the receive buffers of
        its first ``RECEIVE_BUFFERS`` updates (faulted in first, ``ByteBudget.prepare``, as far as the buffer has
        room; updates may then stream in); and their checkpoints are spaced by ``busy_checkpoint_interval`` while
        a crowd of one-message calls is in flight (``Admission.crowded``)."""
        def prepare(aggregation: Aggregation) -> None:
            sizes = [layer.size * wire.numpy_dtype(layer.dtype).itemsize for layer in aggregation.layers]
            self.budget.prepare(sizes, RECEIVE_BUFFERS)
            aggregation.receive_ready()  # its first updates may stream in while it warms up further

        devices.prepare_receive, devices.prepare_above = prepare, self.settings.max_message_bytes
        for worker in devices.workers:
            worker.crowded = self.admission.crowded

    def load(self, participation_refusals) -> host_pb.Load:
        """This process's Submit streams, one-message submissions, buffers and refusals (a shard process reports
        it to the control; the control sums every process's), with its ledgers' ``participation_refusals``."""
        slots, budget, admission = self.stream_slots, self.budget, self.admission
        return host_pb.Load(active_streams=slots.active, stream_limit=slots.limit, refused_streams=slots.refused,
                            buffered_bytes=budget.used, buffer_limit=budget.limit, refused_batches=budget.refused,
                            one_message_held=admission.held, one_message_limit=admission.workers + admission.queue,
                            refused_one_message=admission.refused, rejections=dict(self.rejections),
                            participation_refusals=dict(participation_refusals))

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
        return self._describe(self.create(request))

    def create(self, request: pb.CreateAggregationRequest, in_line: bool = False) -> Aggregation:
        """The aggregation a CreateAggregationRequest asks for (made, or the same one again); ``in_line``: a DP-SGD
        step's (``Lifecycle.create``)."""
        layers = codec.layers_from_proto(request.layers)
        check_limits(layers, self.settings)
        policy, reject = codec.policy_from_proto(request.policy, len(layers))
        requested = check_id(request.aggregation_id, "aggregation_id") if request.aggregation_id else ""
        privacy = codec.privacy_from_proto(request.privacy) if request.HasField("privacy") else None
        unit = codec.unit_from_proto(request.unit)
        return self.lifecycle.create(requested, layers, policy, reject, privacy, unit,
                                     request.self_asserted_client_ids, in_line=in_line)

    @_status_on_error
    def GetAggregation(self, request: pb.GetAggregationRequest, context) -> pb.Aggregation:
        """All of it for the admin; its spec and state only for a holder of its submit token."""
        token = bearer_token(context.invocation_metadata())
        aggregation = self.check_submitter(token, request.aggregation_id, "read")
        if self.auth.is_admin(token):
            return self._describe(aggregation)
        return pb.Aggregation(aggregation_id=aggregation.id, layers=wire.layer_specs(aggregation.layers),
                              policy=codec.policy_to_proto(aggregation.policy, aggregation.reject_non_finite),
                              state=codec.STATES[aggregation.state], layer_bounds=aggregation.accumulator.bounds,
                              privacy=codec.privacy_to_proto(aggregation.privacy) if aggregation.privacy else None,
                              unit=wire.UNITS[aggregation.unit.value], client_ids=aggregation.client_ids,
                              placement=self._placement(aggregation))

    @_status_on_error
    def ListAggregations(self, request, context) -> pb.ListAggregationsResponse:
        return pb.ListAggregationsResponse(aggregations=[self._describe(a) for a in self.registry.all()])

    @_status_on_error
    def CancelAggregation(self, request: pb.CancelAggregationRequest, context) -> pb.Aggregation:
        refuse_buffer(self.registry.get(request.aggregation_id))
        return self._describe(self.lifecycle.cancel(request.aggregation_id))

    @_status_on_error
    def GetStats(self, request: pb.GetStatsRequest, context) -> pb.AggregationStats:
        return codec.stats_to_proto(self.lifecycle.shards.stats(self.registry.get(request.aggregation_id)))

    def Finalize(self, request: pb.FinalizeRequest, context):
        try:
            if isinstance(request, codec.Malformed):
                raise InvalidArgument(f"malformed Finalize request: {request.reason}")
            limit = self.chunk_limit(request.max_chunk_bytes)
            refuse_buffer(self.registry.get(request.aggregation_id))
            # A large model's result is written into receive buffers its round no longer needs (none beside them,
            # back in the pool once the result is freed); the others wait for the next round, as far as the result
            # leaves room.
            result = self.lifecycle.finalize(request.aggregation_id, result_buffers=self.budget)
            self.budget.fit_pool()
        except ClipdError as e:
            self.refuse(context, e, "Finalize")
        yield pb.FinalizeResponse(stats=codec.stats_to_proto(result.stats))
        for k, total in enumerate(result.sums):
            for chunk in codec.tensor_chunks(k, total, limit - CHUNK_OVERHEAD):
                yield pb.FinalizeResponse(sum=chunk)

    @_status_on_error
    def Step(self, request: wire.StepMessage, context) -> pb.StepResponse:
        """A DP-SGD step in one call (``rpc.steps``): its statistics, release and sums in one message."""
        result = steps.step(self, request, bearer_token(context.invocation_metadata()),
                            self.auth.certified_client(context))
        return pb.StepResponse(stats=codec.stats_to_proto(result.stats),  # (each sum whole: one chunk)
                               sums=[chunk for k, total in enumerate(result.sums)
                                     for chunk in codec.tensor_chunks(k, total, total.nbytes)])

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
            examples=self.lifecycle.shards.stats(aggregation).examples,
            created_unix_seconds=aggregation.created,
            failure_reason=aggregation.failure_reason,
            submit_token=self.auth.submit_tokens.token_for(aggregation.id, aggregation.created),
            privacy=codec.privacy_to_proto(aggregation.privacy) if aggregation.privacy else None,
            planned_ledger_epsilon=aggregation.planned_epsilon,
            unit=wire.UNITS[aggregation.unit.value],
            client_ids=aggregation.client_ids,
            placement=self._placement(aggregation),
        )

    @_status_on_error
    def IssueClientToken(self, request: pb.IssueClientTokenRequest, context) -> pb.ClientToken:
        """A credential for one client id (or a trusted submitter) on an aggregation or a ledger (admin only)."""
        return self.auth.issue(request)

    @_status_on_error
    def DrawClients(self, request: pb.DrawClientsRequest, context) -> pb.DrawClientsResponse:
        """Which candidates the server draws for a private aggregation's release (admin only)."""
        if len(request.client_ids) > MAX_CANDIDATES:
            raise InvalidArgument(f"client_ids: at most {MAX_CANDIDATES} candidates a call, got"
                                  f" {len(request.client_ids)}")
        candidates = [check_id(c, "client_ids") for c in request.client_ids]
        refuse_buffer(self.registry.get(request.aggregation_id))
        aggregation, release, rate, drawn = self.lifecycle.draw_clients(request.aggregation_id, candidates)
        return pb.DrawClientsResponse(aggregation_id=aggregation.id, ledger_id=aggregation.privacy.ledger_id,
                                      release=release, sampling_rate=rate, drawn_client_ids=drawn)

    # Buffered streams (server.streams; rpc/streams.py) -------------------------------------------------
    @property
    def _streams(self):
        if self.streams is None:
            raise FailedPrecondition("this server runs no buffered streams (not with --ray yet)")
        return self.streams

    def _described(self, stream) -> pb.BufferedStream:
        ledger = self.lifecycle.ledgers.describe(stream.privacy.ledger_id)
        return stream_rpcs.describe(stream, ledger["epsilon"] if ledger is not None else 0.0)

    @_status_on_error
    def CreateStream(self, request: pb.CreateStreamRequest, context) -> pb.BufferedStream:
        return self._described(stream_rpcs.create(self._streams, request))

    @_status_on_error
    def GetStream(self, request: pb.GetStreamRequest, context) -> pb.BufferedStream:
        return self._described(self._streams.get(request.stream_id))

    @_status_on_error
    def StopStream(self, request: pb.StopStreamRequest, context) -> pb.BufferedStream:
        stream = self._streams.get(request.stream_id)
        stream.stop("stopped by its caller (StopStream)")
        return self._described(stream)

    @_status_on_error
    def SubmitToStream(self, request: pb.StreamSubmitRequest, context) -> pb.StreamSubmitResponse:
        return stream_rpcs.submit(self, self._streams, request, bearer_token(context.invocation_metadata()),
                                  self.auth.certified_client(context), context)

    @_status_on_error
    def GetStreamClient(self, request: pb.GetStreamClientRequest, context) -> pb.StreamClient:
        """One client's standing in a stream: any client's for the admin, its own for a credential that may submit
        to the stream (the id it submits under)."""
        stream = self._streams.get(request.stream_id)
        token = bearer_token(context.invocation_metadata())
        client = request.client_id
        if not self.auth.is_admin(token):
            filling = stream.buffer()
            self.auth.authorize(token, filling.id, "read")
            client = self.auth.client_identity(token, self.auth.certified_client(context), filling, client)
        return stream_rpcs.client_state(stream, client)

    def GetStreamRelease(self, request: pb.GetStreamReleaseRequest, context):
        try:
            if isinstance(request, codec.Malformed):
                raise InvalidArgument(f"malformed GetStreamRelease request: {request.reason}")
            limit = stream_rpcs.chunk_limit(self, request.max_chunk_bytes)
            aggregation = self._streams.get(request.stream_id).release(request.version)
        except ClipdError as e:
            self.refuse(context, e, "GetStreamRelease")
        yield from stream_rpcs.release_parts(aggregation, limit)

    def WatchReleases(self, request: pb.WatchReleasesRequest, context):
        """Each release after ``after_version`` as it is made, on one of ``WATCHERS`` slots, until the stream stops
        or the caller goes."""
        try:
            if isinstance(request, codec.Malformed):
                raise InvalidArgument(f"malformed WatchReleases request: {request.reason}")
            limit = stream_rpcs.chunk_limit(self, request.max_chunk_bytes)
            stream = self._streams.get(request.stream_id)
            self.watch_slots.acquire()
        except ClipdError as e:
            self.refuse(context, e, "WatchReleases")
        try:
            for aggregation in iter_releases(stream, request.after_version, context.is_active):
                yield from stream_rpcs.release_parts(aggregation, limit)
        except ClipdError as e:  # a kept release gone meanwhile (keep_versions passed while the caller read)
            self.refuse(context, e, "WatchReleases")
        finally:
            self.watch_slots.release()

    @_status_on_error
    def GetLedger(self, request: pb.GetLedgerRequest, context) -> pb.Ledger:
        ledger = self.lifecycle.ledgers.describe(request.ledger_id)
        if ledger is None:
            raise NotFound(f"no ledger {request.ledger_id!r}")
        return codec.ledger_to_proto(ledger)

    @_status_on_error
    def CloseAudit(self, request: pb.CloseAuditRequest, context) -> pb.Ledger:
        """Closes a ledger's canary audit (admin only): the ledger with the audit's bound."""
        return codec.ledger_to_proto(self.lifecycle.ledgers.close_audit(codec.ledger_id(request.ledger_id)))

    @_status_on_error
    def GetPlacement(self, request: pb.GetPlacementRequest, context) -> pb.Placement:
        """Where each shard is summed (the admin, or a holder of the aggregation's submit token)."""
        aggregation = self.check_submitter(bearer_token(context.invocation_metadata()), request.aggregation_id,
                                           "submit to")
        return self._placement(aggregation)

    def _placement(self, aggregation: Aggregation) -> pb.Placement:
        """Its shards and, once every shard host's is known, their endpoints (while one starts: none, and clients
        send to the shared address, which passes each call on)."""
        endpoints = self.lifecycle.shards.endpoints()
        endpoints = endpoints if all(endpoints) else []
        return pb.Placement(aggregation_id=aggregation.id, shards=aggregation.shards,
                            endpoints=[endpoints[k % len(endpoints)] for k in range(aggregation.shards)]
                            if endpoints else [])

    # Streaming ----------------------------------------------------------------------
    def Submit(self, request_iterator, context):
        token = bearer_token(context.invocation_metadata())
        session = SubmitSession(self, token, self.auth.certified_client(context))
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

    @_status_on_error
    def SubmitOne(self, request, context) -> pb.SubmitResponse:
        """One whole batch in one message (:func:`submit_one`), on the admission's pool (``Guard``)."""
        return submit_one(self, request, bearer_token(context.invocation_metadata()),
                          self.auth.certified_client(context), context)

    def check_submitter(self, token: str | None, aggregation_id: str, action: str) -> Aggregation:
        """The aggregation, if ``token`` may submit to it (:meth:`Authenticator.authorize`); to submit, not a
        buffered stream's buffer (:func:`refuse_buffer`)."""
        self.auth.authorize(token, aggregation_id, action)
        aggregation = self.registry.get(aggregation_id)  # (a finalized one refuses batches there)
        return refuse_buffer(aggregation) if action == "submit to" else aggregation


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
