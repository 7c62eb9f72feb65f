"""The clipd Python client: open an aggregation, stream updates into it, get the clipped sums."""

from __future__ import annotations

import base64
import collections
import dataclasses
import itertools
import json
import math
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np

from clipd import wire
from clipd.v1 import clipd_pb2 as pb
from clipd.v1 import clipd_pb2_grpc as pb_grpc

from .errors import ClipdError, FailedPreconditionError, UnavailableError, from_rpc_error
from .privacy import Privacy
from .streams import StreamCalls
from .updates import Layer, as_batch, example_nbytes, iter_updates, rebatch, sum_rows

MiB = 1 << 20


class _ClientsOwn:
    """``submit(wire_dtype=...)``'s default: the client's own (None means each layer's dtype)."""

    def __repr__(self) -> str:
        return "<the client's wire_dtype>"


_CLIENT_WIRE_DTYPE: Any = _ClientsOwn()


@dataclasses.dataclass(frozen=True)
class SubmitReport:
    """What one ``submit`` call delivered (everything in it is acknowledged as summed)."""

    client_id: str
    batches: int
    examples: int
    bytes: int
    reconnects: int
    seconds: float
    resumed_bytes: int = 0  # bytes not sent again after a reconnect: the server had kept them


@dataclasses.dataclass(frozen=True)
class SubmitProgress:
    """Where a failed submission stands (``error.progress``); ``Client.resume(error)`` continues it."""

    aggregation_id: str
    client_id: str
    acknowledged_batches: int  # durably in the sum
    acknowledged_examples: int  # the first examples of the submitted updates
    unacknowledged_batches: int  # numbered, maybe sent, not acknowledged: resume resends them
    _stream: Any = dataclasses.field(repr=False, compare=False)


def _with_progress(error: Exception, stream: _BatchStream | _Spread) -> Exception:
    """``error`` with where the submission stands: ``client_id``, ``acknowledged_examples``, ``progress``."""
    tagged: Any = error  # any exception (a bad update's too): the attributes are added to it
    tagged.progress = SubmitProgress(stream.aggregation_id, stream.client_id, stream.batches_acked,
                                     stream.examples_acked, stream.unacknowledged, stream)
    tagged.client_id = stream.client_id
    tagged.acknowledged_examples = stream.examples_acked
    return error


@dataclasses.dataclass(frozen=True)
class AggregateResult:
    """A finalized aggregation: the clipped sums per layer and the counts."""

    sums: dict[str, np.ndarray]
    examples: int
    clip_counts: dict[str, int]
    non_finite: int
    stats: pb.AggregationStats
    release: pb.Release | None = None  # under a privacy policy: the noise, the bound, epsilon

    @property
    def private(self) -> bool:
        """The sums are a differentially private release (noised; counts withheld or noised)."""
        return self.release is not None


class Client(StreamCalls):
    """A connection to a clipd server.

    Example (with a server on localhost:50051)::

        with Client("localhost:50051") as client:
            agg = client.create_aggregation({"w": (10, 3), "b": (3,)}, l2_norm_clip=1.0)
            client.submit(agg, ({"w": w_i, "b": b_i} for w_i, b_i in examples))
            result = client.finalize(agg)   # result.sums["w"], result.clip_counts, ...

    Every call is retried when the server is unreachable; ``submit`` also
    resumes a dropped stream where the server's acknowledgements stopped, so
    nothing is lost or counted twice. Errors are raised as the typed
    exceptions of ``clipd.client.errors``.

    TLS: ``root_certificates`` (PEM bytes of the CA that signed the server's
    certificate) makes the connection TLS; without it the channel is
    plaintext. For a server with mutual TLS (``tls_client_ca_file``), also pass
    ``client_certificate`` and ``client_key`` (PEM bytes, both or neither): the
    client's certificate chain and its private key. Given without
    ``root_certificates``, the server is verified against the system's CAs.
    ``token`` is the bearer token sent on every call: the admin token, an aggregation's submit token, or a
    client token (:meth:`client_token`), whose client id ``submit`` then uses.

    Large updates: ``submit`` does not copy the arrays it is given (it keeps references until the
    server acknowledges them and encodes each message as it is sent, again after a reconnect), so
    an update of gigabytes costs about ``message_bytes`` more memory, not its size again. Don't modify
    them in place while ``submit`` runs. ``window_bytes`` bounds the bytes of batches sent and not yet
    acknowledged (a batch larger than it is sent alone).

    ``one_message`` (default True): a submission that is one batch of at most ``message_bytes`` (most
    cross-device updates; given as arrays or a pytree, not an iterator) goes as one SubmitOne call, which
    costs the server about what the message costs (no stream, no hello, no placement call); False: always a
    Submit stream. Both are exactly once.

    ``wire_dtype``: None (default) sends each layer in its own dtype; ``"bfloat16"`` or ``"float16"``
    sends the float32 layers' values in that 16-bit format, half the bytes (the server widens them back
    to float32 and sums in float32; other dtypes go as they are); ``submit(wire_dtype=...)`` overrides it.
    bfloat16 keeps float32's range with 8 bits of precision (a relative error up to 2**-9 per value);
    float16 keeps 11 bits but only its range: a value beyond 65504 becomes inf, which makes the example
    non-finite at the server (the aggregation's ``non_finite`` policy then drops, zeroes or refuses it),
    and values below about 6e-5 lose precision (below 3e-8 they become 0). Needs a server that accepts
    16-bit chunks for float32 layers.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        client_certificate: bytes | None = None,
        client_key: bytes | None = None,
        message_bytes: int = 2 * MiB,
        max_message_bytes: int = 16 * MiB,
        window_bytes: int = 256 * MiB,
        timeout: float = 120.0,
        retry_timeout: float = 60.0,
        retry_delay: float = 0.05,
        wire_dtype: str | None = None,
        one_message: bool = True,
    ) -> None:
        wire.check_wire_dtype(wire_dtype)
        if message_bytes > max_message_bytes - 64 * 1024:
            raise ValueError("message_bytes must leave room for the message header under max_message_bytes")
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Reconnect quickly after a dropped connection (the default backoff starts at 1 s).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if (client_certificate is None) != (client_key is None):
            raise ValueError("client_certificate and client_key go together")
        self._credentials = None
        if root_certificates is not None or client_certificate is not None:
            self._credentials = grpc.ssl_channel_credentials(root_certificates, client_key, client_certificate)
        self._options = options
        self._channel = self._open_channel(target)
        self._stub = pb_grpc.ClipdStub(self._channel)
        self._submit = _submit_call(self._channel)
        self._submit_one = _submit_one_call(self._channel)
        self._step = self._channel.unary_unary(wire.STEP_METHOD, request_serializer=None,
                                               response_deserializer=pb.StepResponse.FromString)
        self.steps_in_one_call = True  # False once the server says it has no Step (older, or Ray shard hosts)
        self.max_message_bytes = max_message_bytes
        self.one_message = one_message  # a submission of one batch in one message goes as one SubmitOne call
        self._next_sequences: dict[tuple[str, str], int] = {}  # (aggregation, client) -> its next batch, as known
        self._placements: dict[str, pb.Placement] = {}  # aggregation id -> where its shards are summed
        self._endpoints: dict[str, _Endpoint] = {}  # "host:port" -> its channel and calls
        self._routing_lock = threading.Lock()
        self._metadata = ((wire.AUTHORIZATION_KEY, wire.BEARER + token),) if token else ()
        self.token_client_id = client_token_id(token)  # a client token's client id (None for other tokens)
        self._units: dict[str, tuple[str, str]] = {}  # aggregation id -> (its unit, how its client ids are set)
        self.message_bytes = message_bytes
        self.window_bytes = window_bytes
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self.retry_delay = retry_delay
        self.wire_dtype = wire_dtype
        self._layers: dict[str, list[Layer]] = {}

    # Plumbing ---------------------------------------------------------------------------
    def _open_channel(self, target: str) -> grpc.Channel:
        if self._credentials is not None:
            return grpc.secure_channel(target, self._credentials, self._options)
        return grpc.insecure_channel(target, self._options)

    def close(self) -> None:
        self._channel.close()
        for endpoint in self._endpoints.values():
            endpoint.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request):
        """A unary call, retried while the server is unavailable (every clipd call is idempotent)."""
        return self._retrying(lambda: method(request, timeout=self.timeout, metadata=self._metadata))

    def _retrying(self, attempt):
        """Retries UNAVAILABLE (a server restarting, a connection dropped) and refusals with a retry hint
        (the server busy) for up to ``retry_timeout`` s."""
        deadline = time.monotonic() + self.retry_timeout
        tries = 0
        while True:
            try:
                return attempt()
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                if (error.code != grpc.StatusCode.UNAVAILABLE and error.retry_after is None) \
                        or time.monotonic() > deadline:
                    raise error from None
                time.sleep(_backoff(error, self.retry_delay, tries))
                tries += 1

    # Aggregations -------------------------------------------------------------------------
    def create_aggregation(
        self,
        layers: Any,
        *,
        policy: str = "global",
        l2_norm_clip: float = 1.0,
        layer_clips: Sequence[float] = (),
        rescale_to_unit_norm: bool = False,
        non_finite: str = "zero_example",
        aggregation_id: str | None = None,
        dtype: str = "float32",
        privacy: Privacy | pb.PrivacyPolicy | None = None,
        unit: str = "example",
        self_asserted_client_ids: bool = False,
    ) -> str:
        """Opens an aggregation and returns its id.

        Args:
          layers: ``{name: shape}``, ``{name: (shape, dtype)}``, or a list of
            :class:`~clipd.client.updates.Layer` (see ``layers_like``), in the
            order updates will list them.
          policy: ``global``, ``per_layer_uniform``, ``per_layer_proportional``
            or ``per_layer_explicit`` (then ``layer_clips`` gives each bound).
          l2_norm_clip: the bound C (``inf`` disables clipping).
          rescale_to_unit_norm: divide each clipped example by its bound.
          non_finite: ``zero_example`` (default: dropped and counted),
            ``zero_entries``, ``propagate`` or ``reject``.
          aggregation_id: your own id (creating it again is a no-op); a random one otherwise.
          privacy: release the sum with differential privacy (:class:`~clipd.client.privacy.Privacy`):
            Finalize then returns noised sums and ``result.release``; refused with
            ``FailedPreconditionError`` if the ledger's budget can't afford it.
          unit: what the bound limits: ``example`` (default: each example clipped on its own, DP-SGD) or
            ``client`` (federated learning: each client id contributes once, its examples summed and the sum
            clipped once; a second contribution is refused). See docs/threat-model.md.
          self_asserted_client_ids: where client ids count (unit ``client``, or a correlated stream whose
            participation the server enforces), let the aggregation's submit token name any client id;
            otherwise they come from client tokens (:meth:`client_token`), client certificates or a trusted
            submitter (the admin token, :meth:`submitter_token`). Recorded on every release.
        """
        specs = _layer_specs(layers, dtype)
        request = pb.CreateAggregationRequest(
            policy=wire.clip_policy(policy, non_finite, l2_norm_clip=l2_norm_clip, layer_clips=list(layer_clips),
                                    rescale_to_unit_norm=rescale_to_unit_norm),
            layers=wire.layer_specs(specs), aggregation_id=aggregation_id or uuid.uuid4().hex,
            unit=wire.code_of(wire.UNITS, unit, "unit"), self_asserted_client_ids=self_asserted_client_ids,
        )
        if privacy is not None:
            request.privacy.CopyFrom(privacy.to_proto() if isinstance(privacy, Privacy) else privacy)
        aggregation = self._call(self._stub.CreateAggregation, request)
        self._layers[aggregation.aggregation_id] = specs
        self._units[aggregation.aggregation_id] = (_unit_name(aggregation.unit), aggregation.client_ids)
        return aggregation.aggregation_id

    def client_token(self, client_id: str, *, aggregation: str | None = None, ledger: str | None = None,
                     ttl: float | None = None) -> str:
        """A credential for ``client_id`` (admin only): with it, ``Client(target, token=...)`` submits as that
        client only, to ``aggregation`` or to every aggregation of ``ledger`` (one of the two), until ``ttl``
        seconds from now (None: as long as its aggregation and the server's key). The server counts its holder
        as ``client_id``, whatever a request names: a client can't come back under another name."""
        return self._issue(pb.IssueClientTokenRequest.CLIENT, client_id, aggregation, ledger, ttl).token

    def submitter_token(self, *, aggregation: str | None = None, ledger: str | None = None,
                        ttl: float | None = None) -> str:
        """A trusted submitter's credential (admin only): it may submit under any client id to ``aggregation``
        or to every aggregation of ``ledger``. For a framework that authenticates its own nodes (Flower's
        SuperLink, NVFlare's server) and submits for them; see docs/threat-model.md."""
        return self._issue(pb.IssueClientTokenRequest.SUBMITTER, "", aggregation, ledger, ttl).token

    def _issue(self, role, client_id: str, aggregation: str | None, ledger: str | None,
               ttl: float | None) -> pb.ClientToken:
        if (aggregation is None) == (ledger is None):
            raise ValueError("give one of aggregation= and ledger=")
        return self._call(self._stub.IssueClientToken, pb.IssueClientTokenRequest(
            aggregation_id=aggregation or "", ledger_id=ledger or "", client_id=client_id, role=role,
            ttl_seconds=ttl or 0.0))

    def get_aggregation(self, aggregation_id: str) -> pb.Aggregation:
        """The aggregation: with the admin token all of it (its ``submit_token`` too); with its
        submit token its spec and state only (what a participant needs to submit)."""
        return self._call(self._stub.GetAggregation, pb.GetAggregationRequest(aggregation_id=aggregation_id))

    def list_aggregations(self) -> list[pb.Aggregation]:
        return list(self._call(self._stub.ListAggregations, pb.ListAggregationsRequest()).aggregations)

    def cancel(self, aggregation_id: str) -> pb.Aggregation:
        cancelled = self._call(self._stub.CancelAggregation, pb.CancelAggregationRequest(aggregation_id=aggregation_id))
        self._layers.pop(aggregation_id, None)  # what this client kept of it (a trainer cancels one per step)
        self._units.pop(aggregation_id, None)
        self._forget_placement(aggregation_id)
        return cancelled

    def stats(self, aggregation_id: str) -> pb.AggregationStats:
        return self._call(self._stub.GetStats, pb.GetStatsRequest(aggregation_id=aggregation_id))

    def layers(self, aggregation_id: str) -> list[Layer]:
        if aggregation_id not in self._layers:
            self._describe(aggregation_id)
        return self._layers[aggregation_id]

    def _describe(self, aggregation_id: str) -> None:
        aggregation = self.get_aggregation(aggregation_id)
        self._layers[aggregation_id] = [
            Layer(layer.name, tuple(layer.shape), wire.DTYPE_NAMES[layer.dtype]) for layer in aggregation.layers
        ]
        self._units[aggregation_id] = (_unit_name(aggregation.unit), aggregation.client_ids)
        if aggregation.HasField("placement"):  # (a server older than Aggregation.placement: asked when needed)
            with self._routing_lock:
                self._placements.setdefault(aggregation_id, aggregation.placement)

    # Streaming ------------------------------------------------------------------------------
    def submit(self, aggregation_id: str, updates: Any, *, client_id: str | None = None,
               progress: bool = False, spread: int | None = None, wire_dtype: Any = _CLIENT_WIRE_DTYPE) -> SubmitReport:
        """Streams updates into an aggregation and returns once every one is durably summed.

        ``updates`` is one example (a pytree of arrays, one per layer), a batch
        (the same with a leading batch axis), or an iterable of either. Each is
        checked against the aggregation's layers before anything of it is sent
        (``InvalidUpdateError`` names the layer and the shapes). They are packed
        into messages of about ``message_bytes``; an example larger than that is
        split into chunks.

        A ``client_id`` used before in this aggregation appends: the server says
        where that client stands and this submission numbers its batches after
        it. Without one, a client token's client id (see :meth:`client_token`), else the server's choice
        where a credential names the client (a client certificate), else a random one.

        Under unit ``client`` (see :meth:`create_aggregation`) the whole submission is the client's one
        contribution: its examples are summed (float64, rounded once to each layer's dtype) and sent as one
        batch of one row, on one stream; a second submission of the same client is refused
        (``FailedPreconditionError``). A dropped connection or a restarting server (UNAVAILABLE) is retried
        for up to ``retry_timeout`` seconds without progress, and the stream
        resumes after the last acknowledged batch.

        Spreading: the batches are dealt over ``spread`` streams (default: one per
        shard of the aggregation, see :meth:`placement`), each to the process that
        sums its shard, as clients ``client_id``, ``client_id~1``, ... with
        sequence numbers of their own; a stream takes the next batch whenever it
        has room, so a faster shard takes more. ``spread=1``: one stream, as one
        client. Each stream starts with one of the first batches (so a submission
        of fewer batches than shards opens fewer streams). Where the server names
        an endpoint per shard (``clipd serve --processes N``), every stream goes
        straight to its shard's process.

        On failure the typed error carries ``client_id``, ``acknowledged_examples``
        (examples of this call durably in the sum: with one stream, the first
        ones of ``updates``) and ``progress``; :meth:`resume` sends exactly what
        was not acknowledged.

        The arrays of ``updates`` are not copied (one of the layer's dtype, C-contiguous, little-endian
        is sent as it is, however large): they are held until acknowledged and must not change meanwhile.
        ``wire_dtype`` (default: the client's, see :class:`Client`) None, ``"bfloat16"`` or ``"float16"``:
        the format of the float32 layers' values on the wire. ``progress``: one line on stderr, redrawn
        while data moves: bytes sent (as they are handed to gRPC) and acknowledged, MB/s, a bar for a batch
        of many messages, and what the server reports of a large batch as it works on it (received bytes,
        the highest batch summed, the highest durable).
        """
        if wire_dtype is _CLIENT_WIRE_DTYPE:
            wire_dtype = self.wire_dtype
        wire.check_wire_dtype(wire_dtype)
        layers = self.layers(aggregation_id)
        unit, client_ids = self._units[aggregation_id]  # (described with its layers)
        if client_id is None:
            # Where a credential names the client (a certificate), the server says who it is: name none.
            client_id = self.token_client_id or ("" if client_ids == "credential" else uuid.uuid4().hex)
        if unit == "client":
            contribution = sum_rows(iter_updates(updates, layers), layers)
            if contribution and self.one_message and not progress:
                report = self._one_message(aggregation_id, client_id, contribution, wire_dtype)
                if report is not None:
                    return report
            stream = _BatchStream(aggregation_id, client_id, iter([contribution] if contribution else []),
                                  self.message_bytes, self.window_bytes, wire_dtype)
            return self._stream(stream, progress)
        batches = rebatch(iter_updates(updates, layers), example_nbytes(layers, wire_dtype), self.message_bytes)
        # One batch in one message goes as one SubmitOne call (an iterator's updates come when they come: streamed).
        if self.one_message and not progress and not isinstance(updates, Iterator):
            head: list[list[np.ndarray]] = []
            try:
                head.extend(itertools.islice(batches, 2))
            except Exception as e:  # a bad update: reported by the stream, after the good ones before it
                batches = _raising(e)
            else:
                if len(head) == 1:
                    report = self._one_message(aggregation_id, client_id, head[0], wire_dtype)
                    if report is not None:
                        return report
            batches = itertools.chain(head, batches)
        streams = (spread if spread is not None else self.placement(aggregation_id).shards) if client_id else 1
        if streams < 1:
            raise ValueError(f"spread: at least 1 stream, got {streams}")
        if streams == 1:
            stream = _BatchStream(aggregation_id, client_id, batches, self.message_bytes, self.window_bytes,
                                  wire_dtype)
            return self._stream(stream, progress)
        source = _SharedSource(batches)
        # one batch for each stream to start with (fewer batches: fewer streams)
        firsts: Sequence[list[np.ndarray] | None] = source.take(streams)
        if not firsts:
            firsts = [None]  # nothing to send: one stream says hello and reports where the client stands
        window = max(self.message_bytes, self.window_bytes // len(firsts))
        spread_streams = [_BatchStream(aggregation_id, wire.spread_id(client_id, k),
                                       itertools.chain([first] if first is not None else [], source),
                                       self.message_bytes, window, wire_dtype) for k, first in enumerate(firsts)]
        return self._run_spread(_Spread(spread_streams), progress)

    def _run_spread(self, spread: _Spread, progress: bool) -> SubmitReport:
        """Runs the spread's streams at once, on threads of their own; then the whole submission's report."""
        started, reports, errors = time.perf_counter(), [], []
        bar = _ProgressBar(spread, self.message_bytes) if progress else None
        for stream in spread.streams:
            stream.on_sent = bar.show if bar is not None else None

        def run(stream: _BatchStream) -> None:
            try:
                reports.append(self._stream_attempts(stream, bar))
            except Exception as e:  # reported below, with the whole submission's progress
                errors.append(e)

        threads = [threading.Thread(target=run, args=(s,), name="clipd-spread", daemon=True) for s in spread.streams]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                thread.join()
        finally:
            for stream in spread.streams:
                stream.on_sent = None
            if bar is not None:
                bar.close()
        if errors:
            raise _with_progress(errors[0], spread)
        return SubmitReport(spread.client_id, spread.batches_acked, spread.examples_acked, spread.bytes_acked,
                            sum(r.reconnects for r in reports), time.perf_counter() - started,
                            sum(r.resumed_bytes for r in reports))

    def _one_message(self, aggregation_id: str, client_id: str, batch: list[np.ndarray],
                     wire_dtype: str | None) -> SubmitReport | None:
        """``batch``, the whole submission, as one SubmitOne call; None if it takes more than one message or the
        server has no SubmitOne (the caller streams it then).

        Numbered after what this client knows of ``client_id`` (1 for a new one); a server that says the client
        is further (another submission's batches: ``accepted-sequence``) gets it numbered after that, once.
        Retried as a stream is (unavailable, or a refusal with a retry hint: after that long), the same message
        each time, so the server drops a copy it already holds. On failure the error carries the submission's
        progress: :meth:`resume` resends the batch on a stream, under the same number and writer.
        """
        writer = uuid.uuid4().hex
        sequence = self._next_sequences.get((aggregation_id, client_id), 1) if client_id else 1
        message = wire.submit_batch(aggregation_id, client_id, sequence, batch, self.message_bytes, writer, wire_dtype)
        if len(message) != 1:
            return None
        started, reconnects, renumbered = time.perf_counter(), 0, False
        deadline = time.monotonic() + self.retry_timeout
        while True:
            try:
                response = self._submit_one_to(aggregation_id, client_id)(message[0], timeout=self.timeout,
                                                                           metadata=self._metadata)
                break
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                trailing = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
            if error.code == grpc.StatusCode.UNIMPLEMENTED and not reconnects:
                self.one_message = False  # a server older than SubmitOne: stream from now on
                return None
            accepted = trailing.get(wire.ACCEPTED_SEQUENCE_KEY)
            if error.code == grpc.StatusCode.FAILED_PRECONDITION and accepted is not None and not renumbered:
                sequence, renumbered = int(accepted) + 1, True  # (refused before anything of it was taken)
                message = wire.submit_batch(aggregation_id, client_id, sequence, batch, self.message_bytes, writer,
                                            wire_dtype)
                continue
            if not error.retryable or time.monotonic() > deadline:
                unfinished = _BatchStream(aggregation_id, client_id, iter(()), self.message_bytes, self.window_bytes,
                                          wire_dtype)
                unfinished.hold_sent(sequence, batch, writer)
                raise _with_progress(error, unfinished) from None
            if error.code == grpc.StatusCode.UNAVAILABLE:  # its shard's process may have moved: ask again
                self._forget_placement(aggregation_id)
            reconnects += 1
            time.sleep(_backoff(error, self.retry_delay, reconnects - 1))
        client_id = response.client_id or client_id
        self._next_sequences[(aggregation_id, client_id)] = max(sequence, response.accepted_sequence) + 1
        return SubmitReport(client_id, 1, batch[0].shape[0], sum(a.nbytes for a in batch), reconnects,
                            time.perf_counter() - started)

    def resume(self, error: ClipdError, *, progress: bool = False) -> SubmitReport:
        """Continues the submission that raised ``error``: resends its unacknowledged batches with
        their original sequence numbers (so the server drops any it already holds), then the rest.

        The report counts the whole submission, this call and the failed one together.
        """
        where: SubmitProgress | None = getattr(error, "progress", None)
        if where is None:
            raise ValueError("resume takes an error raised by Client.submit or Client.resume")
        stream = where._stream
        if isinstance(stream, _Spread):
            for part in stream.streams:
                part.source_error = None
            return self._run_spread(stream, progress)
        stream.source_error = None
        return self._stream(stream, progress)

    def _stream(self, stream: _BatchStream, progress: bool) -> SubmitReport:
        if not progress:
            return self._stream_attempts(stream, None)
        bar = _ProgressBar(stream, self.message_bytes)
        stream.on_sent = bar.show
        try:
            return self._stream_attempts(stream, bar)
        finally:
            stream.on_sent = None
            bar.close()

    def _stream_attempts(self, stream: _BatchStream, bar: _ProgressBar | None) -> SubmitReport:
        """Runs one stream to the end, reconnecting while the server is unavailable (``bar``: redrawn on
        every response; the stream's ``on_sent`` redraws it as each message is handed to gRPC)."""
        started, failures, reconnects = time.perf_counter(), 0, 0
        last_progress = time.monotonic()
        while True:
            acked_before = stream.acked
            responses = None
            try:
                responses = self._submit_to(stream.aggregation_id, stream.client_id)(
                    stream.requests(), metadata=self._metadata)
                greeted = False
                for response in responses:
                    if not greeted:  # the answer to this attempt's hello
                        stream.greet(response)
                        greeted = True
                    else:  # an acknowledgement, or a report of progress within a large batch: idempotent
                        stream.acknowledge(response.acknowledged_sequence)
                    stream.observe(response)
                    if bar is not None:
                        bar.show()
                if stream.complete:
                    stream.stop()
                    if stream.source_error is not None:
                        raise _with_progress(stream.source_error, stream)
                    return SubmitReport(stream.client_id, stream.batches_acked, stream.examples_acked,
                                        stream.bytes_acked, reconnects, time.perf_counter() - started,
                                        stream.resumed_bytes)
                error: ClipdError = UnavailableError("the stream ended before every batch was acknowledged")
            except grpc.RpcError as e:
                error = from_rpc_error(e)
            except ClipdError as e:  # the client's own checks (greet), or the placement refused
                if responses is not None:
                    responses.cancel()
                error = e
            if stream.acked > acked_before:
                failures, last_progress = 0, time.monotonic()
            else:
                failures += 1
            if not error.retryable or time.monotonic() - last_progress > self.retry_timeout:
                stream.stop()
                raise _with_progress(error, stream) from None
            if error.code == grpc.StatusCode.UNAVAILABLE:  # its shard's process may have moved: ask again
                self._forget_placement(stream.aggregation_id)
            reconnects += 1
            time.sleep(_backoff(error, self.retry_delay, failures))

    # Routing -------------------------------------------------------------------------------
    def placement(self, aggregation_id: str) -> pb.Placement:
        """Where the aggregation's shards are summed (asked once, and again after a shard's endpoint failed).

        A server without placement (older than clipd 0.x's GetPlacement) has one shard behind its address.
        """
        with self._routing_lock:
            known = self._placements.get(aggregation_id)
        if known is not None:
            return known
        try:
            placement = self._call(self._stub.GetPlacement, pb.GetPlacementRequest(aggregation_id=aggregation_id))
        except ClipdError as e:
            if e.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            placement = pb.Placement(aggregation_id=aggregation_id, shards=1)
        with self._routing_lock:
            self._placements[aggregation_id] = placement
        return placement

    def _submit_to(self, aggregation_id: str, client_id: str):
        """The Submit call that reaches the process summing ``client_id``'s shard (this client's channel
        when the server names no endpoints)."""
        endpoint = self._endpoint(self.placement(aggregation_id), client_id)
        return endpoint.submit if endpoint is not None else self._submit

    def _submit_one_to(self, aggregation_id: str, client_id: str):
        """The SubmitOne call to make: straight to ``client_id``'s shard's process if this client knows the
        aggregation's placement already, else on this client's channel (the server passes it on: no call
        to learn the placement first)."""
        with self._routing_lock:
            placement = self._placements.get(aggregation_id)
        endpoint = self._endpoint(placement, client_id) if placement is not None and client_id else None
        return endpoint.submit_one if endpoint is not None else self._submit_one

    def _endpoint(self, placement: pb.Placement, client_id: str) -> _Endpoint | None:
        """The endpoint of the process that sums ``client_id``'s shard; None where the server names none."""
        if not placement.endpoints:
            return None
        address = placement.endpoints[wire.shard_of(client_id, placement.shards)]
        with self._routing_lock:
            if address not in self._endpoints:
                channel = self._open_channel(address)
                self._endpoints[address] = _Endpoint(channel, _submit_call(channel), _submit_one_call(channel))
            return self._endpoints[address]

    def _forget_placement(self, aggregation_id: str) -> None:
        with self._routing_lock:
            self._placements.pop(aggregation_id, None)

    def finalize(self, aggregation_id: str) -> AggregateResult:
        """Closes the aggregation (after its last accepted batch) and returns the sums.

        Safe to call again: the server keeps the result until the aggregation is cancelled.
        """
        return self._retrying(lambda: self._finalize_once(aggregation_id))

    def _finalize_once(self, aggregation_id: str) -> AggregateResult:
        chunk_bytes = max(wire.FINALIZE_MIN_CHUNK_BYTES, self.message_bytes)
        return _result_of(self._stub.Finalize(pb.FinalizeRequest(aggregation_id=aggregation_id,
                                                                 max_chunk_bytes=chunk_bytes),
                                              timeout=self.timeout, metadata=self._metadata))

    def step(self, aggregation_id: str, layers: Any, gradients: Any, *, privacy: Privacy | pb.PrivacyPolicy,
             policy: str = "global", l2_norm_clip: float = 1.0, client_id: str = "trainer", previous_id: str = "",
             wire_dtype: Any = _CLIENT_WIRE_DTYPE) -> AggregateResult | None:
        """One DP-SGD step in one call (what :class:`~clipd.client.DpSgd` does each step): the server creates
        the aggregation ``aggregation_id`` (``layers``, ``policy``, ``l2_norm_clip`` and ``privacy`` as
        :meth:`create_aggregation` takes them), sums ``gradients`` into it (one batch, ``{layer: (B, *shape)}``,
        checked against the layers before anything is sent; None: an empty sample, a release of noise alone),
        finalizes it and answers with its release, as :meth:`finalize` returns it; then it drops ``previous_id``
        (an earlier step's finalized aggregation; its release stays on the ledger).

        ``aggregation_id`` names the step: a retry (this call retries a dropped connection or a restarting server
        as every call does) sends the same request, and the server finishes the step from where it got, or
        returns its release as recorded: the ledger counts the step once. Refused by the ledger's budget
        (``FailedPreconditionError``) before anything is summed; a refused step leaves no aggregation.

        None, with nothing done, where the step can't be one call: its request or its answer would pass
        ``max_message_bytes`` (or the server's limit), or the server has no Step (an older server, or one whose
        every batch is summed by Ray shard hosts). Then create, submit and finalize it.
        """
        if not self.steps_in_one_call:
            return None
        if wire_dtype is _CLIENT_WIRE_DTYPE:
            wire_dtype = self.wire_dtype
        specs = _layer_specs(layers, "float32")
        batch = as_batch(gradients, specs) if gradients is not None else None
        spec = pb.CreateAggregationRequest(
            policy=wire.clip_policy(policy, "zero_example", l2_norm_clip=l2_norm_clip),
            layers=wire.layer_specs(specs), aggregation_id=aggregation_id)
        spec.privacy.CopyFrom(privacy.to_proto() if isinstance(privacy, Privacy) else privacy)
        if wire.step_answer_nbytes((layer.shape, layer.dtype) for layer in specs) > self.max_message_bytes:
            return None
        request = wire.step_request(spec, client_id, batch, uuid.uuid4().hex, previous_id, wire_dtype)
        if len(request) > self.max_message_bytes:
            return None
        try:
            response = self._retrying(lambda: self._step(request, timeout=self.timeout, metadata=self._metadata))
            return _result_from(response.stats, response.sums)
        except ClipdError as e:
            if e.code == grpc.StatusCode.UNIMPLEMENTED:
                self.steps_in_one_call = False
                return None
            if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after is None:
                return None  # larger than the server's message limit: nothing of it was read
            raise

    def ledger(self, ledger_id: str) -> pb.Ledger:
        """A privacy ledger: its releases (DpEvents as JSON), epsilon so far and budget left."""
        return self._call(self._stub.GetLedger, pb.GetLedgerRequest(ledger_id=ledger_id))

    def _specs(self, layers: Any, dtype: str) -> list[Layer]:
        return _layer_specs(layers, dtype)

    def _credential_client(self) -> str | None:
        token = next((value[len(wire.BEARER):] for key, value in self._metadata if key == wire.AUTHORIZATION_KEY),
                     None)
        return client_token_id(token)

    def draw_clients(self, aggregation_id: str, candidates) -> list[str]:
        """The candidates (client ids) that take part in the release of ``aggregation_id``, whose ledger's
        sampling the server draws (``Privacy(..., sampling="poisson", sampling_rate=q, drawn_by="server")``;
        admin): the server's draw for each, in the order given, the same every time it is asked. Train these
        only: the others' submissions are refused (``FailedPreconditionError``, "not drawn for this release")."""
        drawn: list[str] = []
        for chunk in _draw_chunks([str(c) for c in candidates]):  # (the server takes 100,000 a call)
            response = self._call(self._stub.DrawClients,
                                  pb.DrawClientsRequest(aggregation_id=aggregation_id, client_ids=chunk))
            drawn.extend(response.drawn_client_ids)
        return drawn

    def close_audit(self, ledger_id: str) -> pb.Ledger:
        """Closes the ledger's canary audit (admin): the ledger, with the audit's lower bound on epsilon
        (``.audit.epsilon_lower``) beside the epsilon claimed (``.audit.epsilon_claimed``). Later releases
        carry no canaries; closing a closed audit returns it as it is."""
        return self._call(self._stub.CloseAudit, pb.CloseAuditRequest(ledger_id=ledger_id))


def _draw_chunks(candidates: list[str], size: int = 100_000) -> list[list[str]]:
    return [candidates[i:i + size] for i in range(0, len(candidates), size)] or [[]]


def client_token_id(token: str | None) -> str | None:
    """The client id a client token names (its fields are readable; the server checks its signature), None for
    any other token.

    >>> client_token_id("cct1_eyJyb2xlIjoiY2xpZW50IiwiY2xpZW50X2lkIjoiYWxpY2UifQ.sig")
    'alice'
    """
    if not token or not token.startswith(wire.CLIENT_TOKEN_PREFIX):
        return None
    payload = token[len(wire.CLIENT_TOKEN_PREFIX):].partition(".")[0]
    try:
        fields = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except ValueError:
        return None
    return fields.get("client_id") or None if fields.get("role") == "client" else None


def _unit_name(code: int) -> str:
    return next((name for name, known in wire.UNITS.items() if known == code), "example")


def _submit_call(channel: grpc.Channel):
    """Submit on ``channel``, sending messages the client serialized itself (clipd.wire): one copy of the data."""
    return channel.stream_stream(wire.SUBMIT_METHOD, request_serializer=None,
                                 response_deserializer=pb.SubmitResponse.FromString)


class _Endpoint(NamedTuple):
    """A shard process's endpoint: its channel, and Submit and SubmitOne on it."""

    channel: grpc.Channel
    submit: Any
    submit_one: Any


def _raising(error: Exception) -> Iterator[list[np.ndarray]]:
    """A source of batches whose next one is ``error``."""
    raise error
    yield  # (a generator)


def _result_of(responses) -> AggregateResult:
    """A Finalize answer, read as it streams in: its statistics and release (the server's first message), then the
    sums in chunks, each copied into its place and let go (a large model's result costs its size once)."""
    responses = iter(responses)
    first = next(responses)
    assert first.HasField("stats")  # the server's first response carries them
    return _result_from(first.stats, (response.sum for response in itertools.chain((first,), responses)
                                      if response.HasField("sum")))


def _result_from(stats: pb.AggregationStats, chunks) -> AggregateResult:
    """A finalized aggregation's result from its statistics and its sums' chunks (in order; each at its offset in
    its tensor, which is made at its size when its first chunk comes)."""
    buffers: dict[int, np.ndarray] = {}
    layouts: dict[int, tuple[str, tuple[int, ...]]] = {}
    for chunk in chunks:
        buffer = buffers.get(chunk.layer)
        if buffer is None:
            layouts[chunk.layer] = (wire.DTYPE_NAMES[chunk.dtype], tuple(chunk.shape))
            size = math.prod(chunk.shape) * wire.numpy_dtype(layouts[chunk.layer][0]).itemsize
            buffer = buffers[chunk.layer] = np.empty(size, np.uint8)
        end = chunk.offset + len(chunk.data)
        if end > buffer.size:
            raise ClipdError(f"the server sent layer {chunk.layer}'s bytes up to {end}, past its size"
                             f" {buffer.size}", grpc.StatusCode.INTERNAL)
        buffer[chunk.offset:end] = np.frombuffer(chunk.data, np.uint8)
    # Writable: a trainer may update them in place.
    sums = {layer.name: wire.as_array(buffers[k], *layouts[k]) for k, layer in enumerate(stats.layers)}
    return AggregateResult(
        sums=sums,
        examples=stats.examples,
        clip_counts={layer.name: layer.clipped for layer in stats.layers},
        non_finite=stats.non_finite,
        stats=stats,
        release=stats.release if stats.HasField("release") else None,
    )


def _submit_one_call(channel: grpc.Channel):
    """SubmitOne on ``channel``, its one message serialized by the client itself (clipd.wire)."""
    return channel.unary_unary(wire.SUBMIT_ONE_METHOD, request_serializer=None,
                               response_deserializer=pb.SubmitResponse.FromString)


class _SharedSource:
    """One submission's batches, taken by several streams: whichever has room takes the next."""

    def __init__(self, batches: Iterator[list[np.ndarray]]) -> None:
        self._batches = batches
        self._lock = threading.Lock()

    def take(self, n: int) -> list[list[np.ndarray]]:
        """Up to ``n`` batches now (one for each stream to start with)."""
        return list(itertools.islice(self, n))

    def __iter__(self) -> _SharedSource:
        return self

    def __next__(self) -> list[np.ndarray]:
        with self._lock:
            return next(self._batches)


class _Spread:
    """A submission spread over streams (``client_id``, ``client_id~1``, ...), with its totals."""

    def __init__(self, streams: list[_BatchStream]) -> None:
        self.streams = streams
        self.aggregation_id, self.client_id = streams[0].aggregation_id, streams[0].client_id

    batches_acked = property(lambda self: sum(s.batches_acked for s in self.streams))
    examples_acked = property(lambda self: sum(s.examples_acked for s in self.streams))
    bytes_acked = property(lambda self: sum(s.bytes_acked for s in self.streams))
    unacknowledged = property(lambda self: sum(s.unacknowledged for s in self.streams))
    # What the progress line shows (each stream numbers its own batches: no sequence numbers here).
    wire_bytes_sent = property(lambda self: sum(s.wire_bytes_sent for s in self.streams))
    wire_bytes_acked = property(lambda self: sum(s.wire_bytes_acked for s in self.streams))
    received_bytes = property(lambda self: sum(s.received_bytes for s in self.streams))
    summed_sequence = durable_sequence = 0

    def in_flight(self) -> tuple[int, int, int] | None:
        """The largest batch being sent by any stream (see ``_BatchStream.in_flight``)."""
        batches = [b for b in (s.in_flight() for s in self.streams) if b is not None]
        return max(batches, key=lambda b: b[2]) if batches else None


def _backoff(error: ClipdError, delay: float, tries: int) -> float:
    """Seconds before the next try: the server's hint if it gave one, else exponential from ``delay``."""
    wait = min(2.0, delay * 2**tries)
    if error.retry_after is not None:
        wait = max(wait, error.retry_after * (1.0 + 0.25 * random.random()))  # spread the herd
    return wait


def _layer_specs(layers: Any, dtype: str) -> list[Layer]:
    if isinstance(layers, dict):
        out = []
        for name, value in layers.items():
            if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
                shape, layer_dtype = value
            else:
                shape, layer_dtype = value, dtype
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            out.append(Layer(str(name), shape, layer_dtype))
        return out
    return [Layer(layer[0], tuple(layer[1]), layer[2] if len(layer) > 2 else dtype) for layer in layers]


def _amount(nbytes: float) -> str:
    """
    >>> _amount(1_500_000), _amount(4_294_967_296)
    ('1.5 MB', '4.29 GB')
    """
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _progress_line(*, sent: int, acked: int, examples: int, elapsed: float, batch: tuple[int, int, int] | None = None,
                   received: int = 0, summed: int = 0, durable: int = 0, width: int = 24) -> str:
    """The progress line of a submission: ``batch`` (sequence, bytes sent, its bytes) draws a bar.

    >>> _progress_line(sent=3_000_000_000, acked=0, examples=0, elapsed=30.0, batch=(1, 3_000_000_000, 4_000_000_000),
    ...                received=2_000_000_000, summed=0, durable=0, width=8)
    '[######..]  75% of batch 1 (4.00 GB)  sent 3.00 GB  acked 0.0 MB  100.0 MB/s  received 2.00 GB'
    """
    parts = []
    if batch is not None:
        sequence, batch_sent, batch_bytes = batch
        done = min(1.0, batch_sent / max(1, batch_bytes))
        filled = int(done * width)
        bar = "#" * filled + "." * (width - filled)
        parts.append(f"[{bar}] {done:4.0%} of batch {sequence} ({_amount(batch_bytes)})")
    parts += [f"sent {_amount(sent)}", f"acked {_amount(acked)}", f"{sent / max(elapsed, 1e-9) / 1e6:.1f} MB/s"]
    if examples:
        parts.append(f"{examples} examples summed")
    if received:
        parts.append(f"received {_amount(received)}")
    if summed:
        parts.append(f"summed #{summed}")
    if durable:
        parts.append(f"durable #{durable}")
    return "  ".join(parts)


class _ProgressBar:
    """``submit(progress=True)``: one line on stderr, redrawn with ``\\r`` (a newline at the end): bytes handed
    to gRPC and acknowledged, MB/s, and a bar while a batch of several messages is sent. Drawn on every
    response and every message handed to gRPC (so it moves within one large batch), at most every
    ``INTERVAL`` seconds, from whichever thread that is (the stream's, gRPC's request reader)."""

    INTERVAL = 0.1

    def __init__(self, stream: _BatchStream | _Spread, message_bytes: int, file=None) -> None:
        self._stream = stream
        self._message_bytes = message_bytes
        self._file = file if file is not None else sys.stderr
        self._started = time.perf_counter()
        self._lock = threading.Lock()  # one drawer at a time
        self._drawn = -math.inf  # when the line was last drawn
        self._width = 0  # of the last line drawn: a shorter one is padded over it
        self._closed = False

    def line(self) -> str:
        stream = self._stream
        batch = stream.in_flight()
        if batch is not None and batch[2] <= self._message_bytes:
            batch = None  # a bar only for a batch of several messages
        return _progress_line(sent=stream.wire_bytes_sent, acked=stream.wire_bytes_acked,
                              examples=stream.examples_acked, elapsed=time.perf_counter() - self._started,
                              batch=batch, received=stream.received_bytes, summed=stream.summed_sequence,
                              durable=stream.durable_sequence)

    def show(self, end: str = "") -> None:
        """Draws the line, unless it was drawn less than ``INTERVAL`` ago (``end``: always, and then ends it)."""
        now = time.monotonic()
        if not end and (self._closed or now - self._drawn < self.INTERVAL):
            return
        with self._lock:
            if self._closed or (not end and now - self._drawn < self.INTERVAL):
                return
            line = self.line()
            print(f"\r{line}{' ' * max(0, self._width - len(line))}", end=end, file=self._file, flush=True)
            self._width, self._drawn = len(line), now
            self._closed = bool(end)

    def close(self) -> None:
        """Draws the last line and ends it with a newline (once)."""
        self.show(end="\n")


@dataclasses.dataclass
class _Sent:
    sequence: int
    rows: int
    nbytes: int  # the batch's bytes (window accounting)
    batch: list[np.ndarray]  # the caller's arrays (no copy): encoded as sent, again on a resend
    wire_bytes: int  # its tensor data on the wire (a 16-bit wire_dtype halves the float32 layers')
    sent_bytes: int = 0  # of wire_bytes, handed to gRPC by the latest attempt that sent it


class _BatchStream:
    """Numbered batches with a window of unacknowledged ones, resendable on a new stream.

    Each ``requests()`` generator (one per connection attempt) first sends a
    hello and waits for the server's answer (``greet``): on the first attempt it
    says where this client stands, and numbering starts after it. Then it
    resends every batch after the last acknowledgement and pulls new batches
    from the source while fewer than ``window_bytes`` are unacknowledged.
    """

    def __init__(self, aggregation_id: str, client_id: str, batches: Iterator[list[np.ndarray]],
                 message_bytes: int, window_bytes: int, wire_dtype: str | None = None) -> None:
        self.aggregation_id = aggregation_id
        self.client_id = client_id
        self.writer_id = uuid.uuid4().hex  # this submission, as the server tells writers apart
        self._source = batches
        self._source_lock = threading.Lock()
        self._cond = threading.Condition()
        self._window: collections.deque[_Sent] = collections.deque()
        self._unacked_bytes = 0
        self._next_sequence: int | None = None  # known once the server has answered the first hello
        self._greetings = 0
        self._held: tuple[int, list[int]] | None = None  # (sequence, bytes per layer) the server kept of a batch
        self.resumed_bytes = 0  # bytes not sent again: the server kept them from a broken stream
        self._generation = 0
        self._exhausted = False
        self.source_error: Exception | None = None  # a bad update: nothing after it is sent
        self.message_bytes = message_bytes
        self.window_bytes = window_bytes
        self.wire_dtype = wire.check_wire_dtype(wire_dtype)
        self.acked = 0  # the client's highest acknowledged sequence
        self.batches_acked = 0  # of this submission
        self.examples_acked = 0
        self.bytes_acked = 0
        self.wire_bytes_acked = 0  # the bytes on the wire of the acknowledged batches
        self.received_bytes = 0  # what the server says it received of this stream (0: it does not say)
        self.summed_sequence = 0  # the highest batch in the sum, not yet durable, by the server (0: unsaid)
        self.on_sent: Callable[[], None] | None = None  # called as each message is handed to gRPC (progress)

    @property
    def durable_sequence(self) -> int:
        """The client's highest batch durably in the sum (the server's acknowledgement)."""
        return self.acked

    @property
    def wire_bytes_sent(self) -> int:
        """Bytes of tensor data handed to gRPC: the acknowledged batches' and what the latest attempt
        sent of the others (a resend starts its batch again)."""
        with self._cond:
            return self.wire_bytes_acked + sum(entry.sent_bytes for entry in self._window)

    def in_flight(self) -> tuple[int, int, int] | None:
        """``(sequence, bytes sent, its bytes on the wire)`` of the latest batch sent (or being sent) and
        not acknowledged; None if none."""
        with self._cond:
            for entry in reversed(self._window):
                if entry.sent_bytes:
                    return entry.sequence, entry.sent_bytes, entry.wire_bytes
        return None

    def observe(self, response: pb.SubmitResponse) -> None:
        """Takes what a response says of the server's progress within large batches (servers that send
        ``received_bytes`` and ``summed_sequence``; 0 where they are unknown)."""
        received = getattr(response, "received_bytes", 0)
        summed = getattr(response, "summed_sequence", 0)
        with self._cond:
            if received:
                self.received_bytes = received
            if summed:
                self.summed_sequence = max(self.summed_sequence, summed)

    @property
    def complete(self) -> bool:
        with self._cond:
            return self._exhausted and not self._window and self._next_sequence is not None

    @property
    def unacknowledged(self) -> int:
        with self._cond:
            return len(self._window)

    def greet(self, response: pb.SubmitResponse) -> None:
        """Takes the server's answer to a hello: where this client stands."""
        with self._cond:
            if response.client_id and not self.client_id:  # counted under its credential's client id
                self.client_id = response.client_id
            if self._next_sequence is None:  # a new submission: number after what the server has
                self._next_sequence = response.accepted_sequence + 1
                self.acked = response.acknowledged_sequence
            elif (self._window and response.writer_id not in ("", self.writer_id)
                  and response.accepted_sequence >= self._window[0].sequence):
                raise FailedPreconditionError(
                    f"client {self.client_id!r}: another submission wrote batches after this one's"
                    f" {self._window[0].sequence - 1}; resending would be taken as duplicates"
                )
            self._greetings += 1
            self._acknowledge_locked(response.acknowledged_sequence)
            # A resumed hello's answer: the server holds part of this batch (bytes per layer on the wire).
            partial = getattr(response, "partial_sequence", 0)
            self._held = (partial, list(response.partial_bytes)) if partial else None
            if partial:
                self.resumed_bytes += sum(response.partial_bytes)

    def acknowledge(self, sequence: int) -> None:
        with self._cond:
            self._acknowledge_locked(sequence)

    def hold_sent(self, sequence: int, batch: list[np.ndarray], writer: str) -> None:
        """The whole submission is ``batch``, already sent as ``sequence`` by ``writer`` (a one-message
        submission that failed) and not acknowledged: a resume resends it under that number and writer."""
        with self._cond:
            self.writer_id = writer
            self._hold_locked(sequence, batch)
            self._exhausted = True

    def _hold_locked(self, sequence: int, batch: list[np.ndarray]) -> _Sent:
        """``batch`` numbered ``sequence``, kept in the window until acknowledged; the next one is numbered after."""
        entry = _Sent(sequence, batch[0].shape[0], sum(a.nbytes for a in batch), batch,
                      wire.wire_nbytes(batch, self.wire_dtype))
        self._next_sequence = sequence + 1
        self._window.append(entry)
        self._unacked_bytes += entry.nbytes
        return entry

    def _acknowledge_locked(self, sequence: int) -> None:
        while self._window and self._window[0].sequence <= sequence:
            done = self._window.popleft()
            self._unacked_bytes -= done.nbytes
            self.batches_acked += 1
            self.examples_acked += done.rows
            self.bytes_acked += done.nbytes
            self.wire_bytes_acked += done.wire_bytes
        self.acked = max(self.acked, sequence)
        self._cond.notify_all()

    def stop(self) -> None:
        """Ends any generator still held by an old call."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def requests(self) -> Iterator[bytes]:
        with self._cond:
            self._generation += 1
            generation = self._generation
            greetings = self._greetings
            self._cond.notify_all()
        with self._cond:  # a reconnect with batches unacknowledged: the server may hold part of one
            resuming = bool(self._window)
        yield wire.submit_request(self.aggregation_id, self.client_id, 0, [], self.writer_id, resume=resuming)
        with self._cond:
            self._cond.wait_for(lambda: generation != self._generation or self._greetings > greetings)
            if generation != self._generation:
                return
            sent = self.acked
        while True:
            with self._cond:
                def ready(sent: int = sent) -> bool:
                    return (generation != self._generation
                            or self._next_to_send(sent) is not None
                            or self._exhausted
                            or self._unacked_bytes < self.window_bytes)

                self._cond.wait_for(ready)
                if generation != self._generation:
                    return
                entry = self._next_to_send(sent)
                if entry is None and self._exhausted:
                    return
            if entry is None:
                entry = self._pull(sent)
                if entry is None:
                    return
            sent = entry.sequence
            with self._cond:  # what the server kept of this batch from the broken stream: not sent again
                held, self._held = (self._held[1], None) if self._held and self._held[0] == entry.sequence else (
                    None, self._held)
            entry.sent_bytes = sum(held) if held else 0
            for message, data_bytes in self._encode_lazily(entry, held):
                if generation != self._generation:  # a newer attempt resends it: stop encoding for this one
                    return
                entry.sent_bytes += data_bytes  # counted as it is handed to gRPC
                if self.on_sent is not None:
                    self.on_sent()
                yield message

    def _next_to_send(self, sent: int) -> _Sent | None:
        for entry in self._window:
            if entry.sequence > sent:
                return entry
        return None

    def _pull(self, sent: int) -> _Sent | None:
        """The next batch from the source, numbered and kept in the window until acknowledged."""
        with self._source_lock:
            with self._cond:
                entry = self._next_to_send(sent)  # another attempt may have pulled it meanwhile
                if entry is not None or self._exhausted:
                    return entry
            try:
                batch = next(self._source, None)
            except Exception as e:  # a bad update (InvalidUpdateError): send nothing more, report it
                self.source_error, batch = e, None
            with self._cond:
                if batch is None:
                    self._exhausted = True
                    self._cond.notify_all()
                    return None
                assert self._next_sequence is not None  # greet set it: requests() pulls only after the answer
                return self._hold_locked(self._next_sequence, batch)

    def _encode_lazily(self, entry: _Sent, held: list[int] | None = None) -> Iterator[tuple[bytes, int]]:
        """A batch's messages with their bytes of tensor data, each made when gRPC asks for the next;
        ``held``: per layer, the bytes the server kept of it from a broken stream (sent from there on)."""
        return wire.encode_batch(self.aggregation_id, self.client_id, entry.sequence, entry.batch,
                                 self.message_bytes, self.writer_id, self.wire_dtype, start=held)

    def _encode(self, sequence: int, batch: list[np.ndarray]) -> list[bytes]:
        """All of a batch's messages at once (the benchmarks' encoder; a stream encodes lazily)."""
        return wire.submit_batch(self.aggregation_id, self.client_id, sequence, batch, self.message_bytes,
                                 self.writer_id, self.wire_dtype)
