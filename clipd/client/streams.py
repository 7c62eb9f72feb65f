"""Buffered streams from Python (FedBuff): clients that never wait for a round, a model version every K updates.

::

    from clipd.client import Buffer, Client, Privacy

    admin = Client("clipd.example.org:50051", token=ADMIN_TOKEN)
    privacy = Privacy(ledger_id="async-1", delta=1e-5, noise_multiplier=1.0, max_participations=20,
                      min_separation=5, release_mean=True)
    stream = admin.create_stream({"w": (784, 10)}, l2_norm_clip=1.0, privacy=privacy,
                                 buffer=Buffer(size=10, max_staleness=8))
    ack = site.submit_to_stream(stream, update, trained_from=version)   # a site's credential; answered once durable
    for release in admin.watch_releases(stream, after=version):        # each new version as it is made
        model = apply(model, release.sums)

A client numbers its contributions to a stream 1, 2, 3, ...; :meth:`StreamCalls.submit_to_stream` does it for
it (asking the server where it stands the first time), and resends the same number after a fault, so a
contribution counts once. See docs/streams.md.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from clipd import wire
from clipd.v1 import clipd_pb2 as pb

from .errors import from_rpc_error
from .privacy import Privacy

__all__ = ["Buffer", "StreamAck", "StreamCalls", "StreamRelease"]


@dataclasses.dataclass(frozen=True)
class Buffer:
    """How a stream releases (``BufferPolicy`` in the proto): a version every ``size`` contributions; a
    contribution ``tau`` versions stale weighs ``(1 + tau)^-staleness_exponent`` and one staler than
    ``max_staleness`` is refused; with ``max_wait`` seconds a buffer of at least ``min_size`` is released once it
    has waited that long; the last ``keep_versions`` releases are kept."""

    size: int
    staleness_exponent: float = 0.5
    max_staleness: int = 10
    max_wait: float = 0.0
    min_size: int = 1
    keep_versions: int = 100

    def to_proto(self) -> pb.BufferPolicy:
        return pb.BufferPolicy(size=self.size, staleness_exponent=self.staleness_exponent,
                               max_staleness=self.max_staleness, max_wait_seconds=self.max_wait,
                               min_size=self.min_size, keep_versions=self.keep_versions)


@dataclasses.dataclass(frozen=True)
class StreamAck:
    """A contribution taken: the version it counts in, its staleness and weight; ``duplicate``: counted before."""

    client_id: str
    sequence: int
    version: int
    staleness: int
    weight: float
    duplicate: bool


@dataclasses.dataclass(frozen=True)
class StreamRelease:
    """One released version: its (noised) sums or mean by layer name, and its release (``pb.Release``: the
    version, contributions, their staleness, the noise and the ledger's epsilon)."""

    version: int
    sums: dict[str, np.ndarray]
    release: pb.Release


class StreamCalls:
    """The buffered-stream calls of :class:`clipd.client.Client` (it mixes them in)."""

    _stub: Any
    message_bytes: int
    timeout: float | None
    _metadata: Any

    def _call(self, method, request):  # (Client's: a unary call, retried while the server is unavailable)
        raise NotImplementedError

    def _specs(self, layers: Any, dtype: str) -> list:  # (Client's: layers read as create_aggregation reads them)
        raise NotImplementedError

    def _credential_client(self) -> str | None:  # (Client's: the client id its client token names, if any)
        raise NotImplementedError

    def create_stream(self, layers: dict[str, Any], *, buffer: Buffer, privacy: Privacy, policy: str = "global",
                      l2_norm_clip: float = 1.0, layer_clips=(), non_finite: str = "zero_example",
                      stream_id: str | None = None, dtype: str = "float32") -> str:
        """Makes a buffered stream (admin) and returns its id; making it again with the same spec is a no-op.
        ``privacy`` must limit participation (``max_participations``, ``min_separation``): asynchronous clients
        are not sampled. With ``release_mean`` each version is the mean over ``buffer.size`` (the public
        denominator, unless the policy gives another). Its buffers count clients (``unit="client"``), whose ids
        come from credentials."""
        specs = self._specs(layers, dtype)
        if privacy.release_mean and not privacy.public_denominator:  # FedBuff's mean over the buffer: K, public
            privacy = dataclasses.replace(privacy, public_denominator=float(buffer.size))
        request = pb.CreateStreamRequest(
            stream_id=stream_id or "", layers=wire.layer_specs(specs), buffer=buffer.to_proto(),
            policy=wire.clip_policy(policy, non_finite, l2_norm_clip=l2_norm_clip, layer_clips=list(layer_clips)),
            privacy=privacy.to_proto())
        stream = self._call(self._stub.CreateStream, request)
        self._stream_layers()[stream.stream_id] = [layer.name for layer in specs]
        return stream.stream_id

    def stream(self, stream_id: str) -> pb.BufferedStream:
        """The stream: its spec, newest version, the open buffer's fill, state, releases per minute, epsilon."""
        return self._call(self._stub.GetStream, pb.GetStreamRequest(stream_id=stream_id))

    def stop_stream(self, stream_id: str) -> pb.BufferedStream:
        """Stops the stream (admin): no more contributions; its buffers not released are dropped."""
        return self._call(self._stub.StopStream, pb.StopStreamRequest(stream_id=stream_id))

    def stream_client(self, stream_id: str, client_id: str) -> pb.StreamClient:
        """What the stream has of one client (admin): its contributions, the versions they count in, its next
        sequence and the first version it may take part in again (0: its limit is reached)."""
        return self._call(self._stub.GetStreamClient, pb.GetStreamClientRequest(stream_id=stream_id,
                                                                                client_id=client_id))

    def submit_to_stream(self, stream_id: str, update: dict[str, np.ndarray], *, trained_from: int,
                         client_id: str | None = None, sequence: int | None = None) -> StreamAck:
        """Sends one client's update (``{layer name: array}``, the whole update), trained from version
        ``trained_from`` (0: the initial model), and returns once it is durable, with the version it counts in.

        ``sequence``: the client's contribution number (default: the next one, numbered here; the first time the
        server is asked where the client stands). A retried call resends the same number: counted once.
        ``FailedPreconditionError``: stale (past ``max_staleness``: train from the newest version), the client
        past its participation limits, or the stream stopped.
        """
        name = client_id or ""
        layers = self._stream_layers().get(stream_id) or [layer.name for layer in self.stream(stream_id).layers]
        self._stream_layers()[stream_id] = layers
        if sequence is None:
            sequence = self._next_stream_sequence(stream_id, name)
        chunks = [pb.TensorChunk(layer=k, dtype=wire.dtype_code(np.asarray(update[n]).dtype),
                                 shape=(1, *np.shape(update[n])), offset=0,
                                 data=np.ascontiguousarray(update[n]).tobytes())
                  for k, n in enumerate(layers)]
        request = pb.StreamSubmitRequest(stream_id=stream_id, client_id=name, sequence=sequence,
                                         trained_from=trained_from, chunks=chunks)
        response = self._call(self._stub.SubmitToStream, request)
        with self._stream_lock():
            self._stream_sequences()[(stream_id, name)] = response.sequence + 1
        return StreamAck(response.client_id, response.sequence, response.version, response.staleness,
                         response.weight, response.duplicate)

    def _next_stream_sequence(self, stream_id: str, name: str) -> int:
        with self._stream_lock():
            known = self._stream_sequences().get((stream_id, name))
        if known is not None:
            return known
        client = name or self._credential_client() or ""
        return self._call(self._stub.GetStreamClient, pb.GetStreamClientRequest(
            stream_id=stream_id, client_id=client)).next_sequence if client else 1

    def stream_release(self, stream_id: str, version: int) -> StreamRelease:
        """One kept release by version (``NotFoundError`` past ``keep_versions``)."""
        parts = self._stub.GetStreamRelease(pb.GetStreamReleaseRequest(
            stream_id=stream_id, version=version, max_chunk_bytes=max(wire.FINALIZE_MIN_CHUNK_BYTES,
                                                                      self.message_bytes)),
            timeout=self.timeout, metadata=self._metadata)
        return next(_releases(parts, self._names(stream_id)))

    def watch_releases(self, stream_id: str, after: int = 0, timeout: float | None = None
                       ) -> Iterator[StreamRelease]:
        """Each release after version ``after``, as it is made (the kept ones first), until the stream stops
        (or ``timeout`` seconds pass: the call then ends)."""
        parts = self._stub.WatchReleases(pb.WatchReleasesRequest(
            stream_id=stream_id, after_version=after, max_chunk_bytes=max(wire.FINALIZE_MIN_CHUNK_BYTES,
                                                                          self.message_bytes)),
            timeout=timeout, metadata=self._metadata)
        yield from _releases(parts, self._names(stream_id))

    def _names(self, stream_id: str) -> list[str]:
        names = self._stream_layers().get(stream_id)
        if names is None:
            names = self._stream_layers()[stream_id] = [layer.name for layer in self.stream(stream_id).layers]
        return names

    # (state kept on the Client instance, made when first needed)
    def _stream_layers(self) -> dict[str, list[str]]:
        return self.__dict__.setdefault("_stream_layer_names", {})

    def _stream_sequences(self) -> dict[tuple[str, str], int]:
        return self.__dict__.setdefault("_stream_next_sequences", {})

    def _stream_lock(self) -> threading.Lock:
        return self.__dict__.setdefault("_stream_sequence_lock", threading.Lock())


def _releases(parts, names: list[str]) -> Iterator[StreamRelease]:
    """Releases from a stream of parts: each header, then as many chunks as it says (a refusal: its typed
    error, ``clipd.client.errors``)."""
    try:
        yield from _parsed(parts, names)
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None


def _parsed(parts, names: list[str]) -> Iterator[StreamRelease]:
    header: pb.Release | None = None
    left = 0
    buffers: dict[int, bytearray] = {}
    layouts: dict[int, tuple[str, tuple[int, ...]]] = {}
    for part in parts:
        if part.HasField("release"):
            header, left, buffers, layouts = part.release, part.chunks, {}, {}
        else:
            chunk = part.sum
            layouts[chunk.layer] = (wire.DTYPE_NAMES[chunk.dtype], tuple(chunk.shape))
            buffers.setdefault(chunk.layer, bytearray()).extend(chunk.data)
            left -= 1
        if header is not None and left == 0:
            sums = {names[k]: wire.as_array(buffers[k], *layouts[k]) for k in sorted(buffers)}
            yield StreamRelease(header.stream_version, sums, header)
            header = None
