"""The buffered streams' RPCs: thin handlers over ``server.streams`` (which buffer, what weight, when released).

A contribution (``SubmitToStream``) is taken in as a one-message submission is (``submit_one``): who may submit
and as whom (the stream's open buffer is the aggregation a credential is checked against: a client token for the
stream's ledger covers every buffer), the batch assembled within the server's buffer budget, handed to the
lifecycle and answered once durable; what differs is that the stream chooses the buffer and the weight first
(``BufferedStream.take``), before a byte of the update is read. Releases go out as a header (the proto
``Release``) and the sums in chunks, as Finalize's do.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from clipd import wire
from clipd.server.errors import InvalidArgument
from clipd.server.rpc import codec
from clipd.server.rpc.auth import check_id
from clipd.server.rpc.submit import _durable_after, assembler_for
from clipd.server.streams import BufferedStream, BufferPolicy, Streams
from clipd.v1 import clipd_pb2 as pb

CHUNK_OVERHEAD = 1024  # bytes of a StreamReleasePart besides its tensor data


def buffer_from_proto(message: pb.BufferPolicy) -> BufferPolicy:
    try:
        return BufferPolicy(size=message.size, staleness_exponent=message.staleness_exponent,
                            max_staleness=message.max_staleness, max_wait=message.max_wait_seconds,
                            min_size=message.min_size or 1, keep_versions=message.keep_versions or 100)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def buffer_to_proto(policy: BufferPolicy) -> pb.BufferPolicy:
    return pb.BufferPolicy(size=policy.size, staleness_exponent=policy.staleness_exponent,
                           max_staleness=policy.max_staleness, max_wait_seconds=policy.max_wait,
                           min_size=policy.min_size, keep_versions=policy.keep_versions)


def describe(stream: BufferedStream, ledger_epsilon: float) -> pb.BufferedStream:
    spec = stream.spec.aggregation
    return pb.BufferedStream(
        stream_id=stream.id, layers=wire.layer_specs(spec.layers),
        policy=codec.policy_to_proto(spec.policy, spec.reject_non_finite),
        privacy=codec.privacy_to_proto(stream.privacy), buffer=buffer_to_proto(stream.policy),
        version=stream.version, filling=stream.taken, state=stream.state, reason=stream.reason,
        created_unix_seconds=stream.created, releases_per_minute=stream.releases_per_minute(),
        ledger_epsilon=ledger_epsilon)


def create(streams: Streams, request: pb.CreateStreamRequest) -> BufferedStream:
    layers = codec.layers_from_proto(request.layers)
    policy, reject = codec.policy_from_proto(request.policy, len(layers))
    stream_id = check_id(request.stream_id, "stream_id") if request.stream_id else ""
    privacy = codec.privacy_from_proto(request.privacy) if request.HasField("privacy") else None
    return streams.create(stream_id, layers, policy, reject, privacy, buffer_from_proto(request.buffer))


def submit(servicer: Any, streams: Streams, message: pb.StreamSubmitRequest, token: str | None,
           certified: str | None, context) -> pb.StreamSubmitResponse:
    """SubmitToStream: the stream takes the contribution's place (its buffer and weight, or its earlier place);
    the update is assembled, handed to the buffer's lifecycle and answered once durable."""
    stream = streams.get(message.stream_id)
    filling = stream.buffer()  # (the aggregation a credential is checked against)
    servicer.auth.authorize(token, filling.id, "submit to")
    client = servicer.auth.client_identity(token, certified, filling, message.client_id)
    slot = stream.take(client, message.sequence, message.trained_from)
    answer = pb.StreamSubmitResponse(client_id=slot.client, sequence=slot.sequence, version=slot.version,
                                     staleness=slot.staleness, weight=slot.weight, duplicate=slot.duplicate)
    try:
        if slot.duplicate:
            if slot.aggregation is not None:  # in a buffer not released yet: answered once durable there
                _durable_after(slot.aggregation, slot.client, 1, context)
            return answer
        aggregation = slot.aggregation
        assert aggregation is not None
        assembler = assembler_for(aggregation, servicer.settings, servicer.budget)
        try:
            chunks = [wire.Chunk(c.layer, c.dtype, tuple(c.shape), c.offset, c.data) for c in message.chunks]
            batch = assembler.add(1, chunks)  # (each protobuf field read once: its bytes are copied per read)
            if batch is None:
                raise InvalidArgument("SubmitToStream takes a whole update in one message")
        finally:
            assembler.discard()
        if batch.rows != 1:
            batch.give_back()
            raise InvalidArgument(f"a stream contribution is one row per layer (a client's whole update), got"
                                  f" {batch.rows}")
        del message
        servicer.payload_bytes += batch.nbytes
        aggregation.attach(slot.client, slot.writer)
        try:
            servicer.lifecycle.submit(aggregation, slot.client, slot.writer, batch._replace(weight=slot.weight))
            stream.summed(slot)
            del batch
            _durable_after(aggregation, slot.client, 1, context)
        finally:
            aggregation.detach(slot.client, slot.writer)
        return answer
    finally:
        stream.done(slot)


def release_parts(aggregation, limit: int) -> Iterator[pb.StreamReleasePart]:
    """A released buffer on the wire: its release (the header, with how many chunks follow), then its sums."""
    result = aggregation.result
    chunks = [chunk for k, total in enumerate(result.sums) for chunk in codec.tensor_chunks(k, total, limit)]
    yield pb.StreamReleasePart(release=codec.release_to_proto(aggregation.release), chunks=len(chunks))
    for chunk in chunks:
        yield pb.StreamReleasePart(sum=chunk)


def client_state(stream: BufferedStream, client_id: str) -> pb.StreamClient:
    return pb.StreamClient(**stream.client(check_id(client_id, "client_id")))


def chunk_limit(servicer: Any, requested: int) -> int:
    return servicer.chunk_limit(requested) - CHUNK_OVERHEAD
