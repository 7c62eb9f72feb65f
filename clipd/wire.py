"""The clipd wire protocol: what client and server must both know beyond the messages of the .proto.

Owns, once for both sides: the enums by name (their .proto names in lower case: the client's
arguments, and the values of the engine's enums; ``float32`` ... are the DType codes' numpy names);
the byte order of tensors (little-endian) and how they are cut into chunks; the 16-bit wire formats a
float32 layer may be sent in (``to_wire_dtype``, ``widen_into``); the Submit format, both halves (the
client's encoder copies a batch's data once, a message at a time as it is sent, the server's parser not
at all); the metadata keys (retry-after, the bearer credential, SubmitOne's accepted sequence) and the
Submit methods' paths; which shard sums a client id. Imports numpy and ``clipd.v1`` only (``ml_dtypes``
when a bfloat16 layer is met; the 16-bit wire formats need neither it nor JAX), so the client keeps its
small dependency set.

The Submit encoding of a batch of two examples of one float32 layer of shape (3,):

>>> [message] = submit_batch("agg", "alice", 1, [np.arange(6, dtype=np.float32).reshape(2, 3)], 1 << 20, "w")
>>> print(message[:22].hex(" "), "...", message[-3:].hex(" "))
0a 03 61 67 67 12 05 61 6c 69 63 65 18 01 22 20 10 01 1a 02 02 03 ... 2a 01 77

that is: field 1 (aggregation_id; tag ``1 << 3 | 2``: length-delimited) of 3 bytes, "agg"; field 2
(client_id) "alice"; field 3 (sequence) the varint 1; field 4 a TensorChunk of 32 bytes: dtype 1
(FLOAT32), shape [2, 3] packed, the 24 data bytes (``2a 18 ...``; layer and offset 0 are left out,
as proto3 leaves out defaults); field 5 (writer_id) "w". ``parse_submit_request`` reads it back.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from clipd.v1 import clipd_pb2 as pb

RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of a refusal about the server's load
AUTHORIZATION_KEY = "authorization"  # "Bearer <token>": the admin token or an aggregation's submit token
BEARER = "Bearer "
CLIENT_TOKEN_PREFIX = "cct1_"  # a client token: "cct1_<its fields, JSON in base64url>.<the server's MAC>"
SUBMIT_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Clipd'].full_name}/Submit"
SUBMIT_ONE_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Clipd'].full_name}/SubmitOne"
STEP_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Clipd'].full_name}/Step"
ACCEPTED_SEQUENCE_KEY = "accepted-sequence"  # SubmitOne's refusal of a sequence the client is past: where it is
FINALIZE_MIN_CHUNK_BYTES = 64 * 1024  # Finalize's max_chunk_bytes: the least a server accepts...
FINALIZE_DEFAULT_CHUNK_BYTES = 1 << 20  # ...and what 0 means


def retry_after_metadata(seconds: float) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a refusal that may be retried after ``seconds``."""
    return ((RETRY_AFTER_KEY, str(int(seconds * 1000))),)


def retry_after(metadata) -> float | None:
    """The seconds a refusal's trailing metadata asks to wait before retrying; None without a (valid) hint."""
    seconds = None
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY:
            with contextlib.suppress(ValueError):
                seconds = max(0.0, int(value) / 1000)
    return seconds


# Dtypes and enums -------------------------------------------------------------------------------
def _by_name(enum) -> dict[str, Any]:
    """A proto enum's values by their names in lower case, ``*_UNSPECIFIED`` left out (typed where assigned)."""
    return {name.lower(): value for name, value in enum.items() if not name.endswith("_UNSPECIFIED")}


DTYPES: dict[str, pb.DType] = _by_name(pb.DType)  # float32, float16, bfloat16, float64: numpy's names
DTYPE_NAMES: dict[int, str] = {code: name for name, code in DTYPES.items()}
CLIP_KINDS: dict[str, pb.ClipPolicy.Kind] = _by_name(pb.ClipPolicy.Kind)  # global, per_layer_uniform, ...
# zero_example, zero_entries, propagate, reject
NON_FINITE: dict[str, pb.ClipPolicy.NonFinite] = _by_name(pb.ClipPolicy.NonFinite)
SAMPLING: dict[str, pb.Sampling.Kind] = _by_name(pb.Sampling.Kind)  # none, poisson, fixed_size
DRAWN_BY: dict[str, pb.Sampling.DrawnBy] = _by_name(pb.Sampling.DrawnBy)  # caller, server
# add_remove_one, replace_one
NEIGHBOURING: dict[str, pb.PrivacyPolicy.Neighbouring] = _by_name(pb.PrivacyPolicy.Neighbouring)
ACCOUNTANTS: dict[str, pb.PrivacyPolicy.Accountant] = _by_name(pb.PrivacyPolicy.Accountant)  # rdp, pld, zcdp
NOISES: dict[str, pb.PrivacyPolicy.Noise] = _by_name(pb.PrivacyPolicy.Noise)  # gaussian, secure
MECHANISMS: dict[str, pb.CorrelatedNoise.Mechanism] = _by_name(pb.CorrelatedNoise.Mechanism)  # blt, banded
INDEPENDENT = "independent"  # a privacy policy's mechanism without a correlated stream
UNITS: dict[str, pb.PrivacyUnit] = _by_name(pb.PrivacyUnit)  # example, client
TOKEN_ROLES: dict[str, pb.IssueClientTokenRequest.Role] = _by_name(pb.IssueClientTokenRequest.Role)  # client, submitter
_Enum = TypeVar("_Enum", bound=int)  # one of those proto enums


def code_of(names: dict[str, _Enum], name: str, what: str) -> _Enum:
    """``names[name]``, or a ValueError saying what ``what`` may be."""
    if name not in names:
        raise ValueError(f"{what} must be one of {sorted(names)}, got {name!r}")
    return names[name]


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of the wire's dtype ``name``, little-endian (bfloat16 imports ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes  # only needed for bfloat16 layers

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name).newbyteorder("<")


def dtype_code(dtype) -> pb.DType:
    """The ``DType`` of a numpy dtype (KeyError for one the wire has not)."""
    return DTYPES[np.dtype(dtype).name]


def layer_specs(layers) -> list[pb.LayerSpec]:
    """LayerSpec messages of layers with a ``name``, a ``shape`` and a ``dtype`` name."""
    return [pb.LayerSpec(name=layer.name, shape=layer.shape, dtype=DTYPES[layer.dtype]) for layer in layers]


def clip_policy(kind: str, non_finite: str, **fields) -> pb.ClipPolicy:
    """A ClipPolicy message, its enums by name (ValueError naming a wrong one); ``fields`` are its others."""
    return pb.ClipPolicy(kind=code_of(CLIP_KINDS, kind, "policy"),
                         non_finite=code_of(NON_FINITE, non_finite, "non_finite"), **fields)


def privacy_policy(*, sampling: str = "none", sampling_rate: float = 0.0, population: int = 0, sample_size: int = 0,
                   drawn_by: str = "caller", neighbouring: str = "add_remove_one", accountant: str = "rdp",
                   noise: str = "gaussian", noise_multiplier: float | None = None, seed: int | None = None,
                   mechanism: str = INDEPENDENT, releases: int = 0, min_separation: int = 1,
                   max_participations: int = 0, buffers: int = 0, declared_participation: bool = False,
                   **fields) -> pb.PrivacyPolicy:
    """A PrivacyPolicy message from the flat fields of ``clipd.client.Privacy``: enums by name (ValueError
    naming a wrong one), ``noise_multiplier`` and ``seed`` None unset; ``fields`` are the message's others.
    ``mechanism`` other than ``independent``: the correlated stream (``CorrelatedNoise``) of those fields
    (``max_participations`` 0: 1); independent with ``max_participations``: its ``Participation`` limits."""
    if mechanism != INDEPENDENT:
        fields["correlated"] = pb.CorrelatedNoise(
            mechanism=code_of(MECHANISMS, mechanism, "mechanism"), releases=releases, min_separation=min_separation,
            max_participations=max_participations or 1, buffers=buffers, declared=declared_participation)
    elif max_participations:  # independent noise: limits enforced per client identity
        fields["participation"] = pb.Participation(min_separation=min_separation,
                                                   max_participations=max_participations)
    message = pb.PrivacyPolicy(
        sampling=pb.Sampling(kind=code_of(SAMPLING, sampling, "sampling"), rate=sampling_rate,
                             population=population, sample_size=sample_size,
                             drawn_by=code_of(DRAWN_BY, drawn_by, "drawn_by")),
        neighbouring=code_of(NEIGHBOURING, neighbouring, "neighbouring"),
        accountant=code_of(ACCOUNTANTS, accountant, "accountant"), noise=code_of(NOISES, noise, "noise"), **fields,
    )
    if noise_multiplier is not None:
        message.noise_multiplier = noise_multiplier
    if seed is not None:
        message.seed = seed
    return message


# Tensors and chunking ---------------------------------------------------------------------------
def tensor_bytes(array: np.ndarray) -> np.ndarray:
    """``array``'s wire bytes (little-endian, C order) as a flat uint8 array; no copy if it is so already."""
    array = np.ascontiguousarray(array)
    return array.astype(array.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8)


def as_array(data, name: str, shape: Sequence[int]) -> np.ndarray:
    """The tensor whose wire bytes are ``data``: a view of them, no copy (writable if they are)."""
    return np.frombuffer(data, dtype=numpy_dtype(name)).reshape(tuple(shape))


def chunk_offsets(nbytes: int, max_bytes: int) -> range:
    """Where a tensor of ``nbytes`` is cut into chunks of at most ``max_bytes``: in order, one at least."""
    return range(0, max(nbytes, 1), max(1, max_bytes))


SPREAD_MARK = "~"  # "alice~2": the third stream of client alice's submission spread over the shards


def spread_id(client_id: str, stream: int) -> str:
    """The client id of a spread submission's stream ``stream``: the id itself, then ``id~1``, ``id~2``, ..."""
    return f"{client_id}{SPREAD_MARK}{stream}" if stream else client_id


def shard_of(client_id: str, shards: int) -> int:
    """The shard that sums a client's batches (see ``Placement`` in the .proto): stream ``k`` of a
    spread submission lands on the shard after stream ``k - 1``'s, so ``shards`` streams reach each once.

    >>> shard_of("alice", 4), [shard_of(spread_id("alice", k), 4) for k in range(4)]  # crc32("alice") % 4 == 3
    (3, [3, 0, 1, 2])
    """
    base, mark, stream = client_id.rpartition(SPREAD_MARK)
    if mark and stream.isdigit():
        return (zlib.crc32(base.encode()) + int(stream)) % shards
    return zlib.crc32(client_id.encode()) % shards


# The Submit format, both halves: the parser needs nothing of the server (plain Python over a memoryview).
# Field numbers by name, from the generated code (the .proto's own); wire types by type. A field the parser
# does not know is skipped, as protobuf does.
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_AGGREGATION_ID, _CLIENT_ID, _SEQUENCE, _CHUNKS, _WRITER_ID = (
    pb.SubmitRequest.AGGREGATION_ID_FIELD_NUMBER, pb.SubmitRequest.CLIENT_ID_FIELD_NUMBER,
    pb.SubmitRequest.SEQUENCE_FIELD_NUMBER, pb.SubmitRequest.CHUNKS_FIELD_NUMBER,
    pb.SubmitRequest.WRITER_ID_FIELD_NUMBER)
_LAYER, _DTYPE, _SHAPE, _OFFSET, _DATA = (
    pb.TensorChunk.LAYER_FIELD_NUMBER, pb.TensorChunk.DTYPE_FIELD_NUMBER, pb.TensorChunk.SHAPE_FIELD_NUMBER,
    pb.TensorChunk.OFFSET_FIELD_NUMBER, pb.TensorChunk.DATA_FIELD_NUMBER)
_SUBMIT_FIELDS = {f.number for f in pb.SubmitRequest.DESCRIPTOR.fields}
_RESUME = pb.SubmitRequest.DESCRIPTOR.fields_by_name["resume"].number
_CHUNK_FIELDS = {f.number for f in pb.TensorChunk.DESCRIPTOR.fields}
_STEP_AGGREGATION, _STEP_GRADIENTS, _STEP_PREVIOUS_ID = (
    pb.StepRequest.AGGREGATION_FIELD_NUMBER, pb.StepRequest.GRADIENTS_FIELD_NUMBER,
    pb.StepRequest.PREVIOUS_ID_FIELD_NUMBER)
_STEP_FIELDS = {f.number for f in pb.StepRequest.DESCRIPTOR.fields}


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative integer.

    >>> varint(300).hex()
    'ac02'
    """
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _size(part) -> int:
    return part.nbytes if hasattr(part, "nbytes") else len(part)


def _len_field(field: int, value) -> list:
    """A length-delimited field as parts (``value`` not copied); nothing for an empty one, as proto3 writes."""
    size = _size(value)
    return [varint(field << 3 | _LEN), varint(size), value] if size else []


def _uint_field(field: int, value: int) -> bytes:
    return varint(field << 3 | _VARINT) + varint(value) if value else b""


def tensor_chunk(layer: int, dtype: int, shape: Sequence[int], offset: int, data) -> list:
    """The parts of one TensorChunk message (``data``: any bytes-like object, not copied here)."""
    head = (_uint_field(_LAYER, layer) + _uint_field(_DTYPE, dtype)
            + b"".join(_len_field(_SHAPE, b"".join(varint(d) for d in shape))) + _uint_field(_OFFSET, offset))
    return [head, *_len_field(_DATA, data)]


def submit_request(aggregation_id: str, client_id: str, sequence: int, chunks: Sequence[list],
                   writer_id: str = "", resume: bool = False) -> bytes:
    """One serialized SubmitRequest; ``chunks`` are ``tensor_chunk`` results. The data is copied once, here."""
    return b"".join(_submit_parts(aggregation_id, client_id, sequence, chunks, writer_id, resume))


def _submit_parts(aggregation_id: str, client_id: str, sequence: int, chunks: Sequence[list],
                  writer_id: str = "", resume: bool = False) -> list:
    parts: list = [*_len_field(_AGGREGATION_ID, aggregation_id.encode()),
                   *_len_field(_CLIENT_ID, client_id.encode()), _uint_field(_SEQUENCE, sequence)]
    for chunk in chunks:
        parts += [varint(_CHUNKS << 3 | _LEN), varint(sum(_size(p) for p in chunk)), *chunk]
    parts += _len_field(_WRITER_ID, writer_id.encode())
    if resume:
        parts.append(_uint_field(_RESUME, 1))
    return parts


def step_request(aggregation: pb.CreateAggregationRequest, client_id: str, batch: Sequence[np.ndarray] | None,
                 writer_id: str = "", previous_id: str = "", wire_dtype: str | None = None) -> bytes:
    """One serialized StepRequest: the step's aggregation, and its per-example gradients (one array per layer,
    batch axis first; None: an empty sample) as one batch of sequence 1, each layer one chunk. The gradients are
    copied once, here (``wire_dtype`` as :func:`encode_batch`'s).

    >>> request = pb.StepRequest.FromString(step_request(
    ...     pb.CreateAggregationRequest(aggregation_id="run-7"), "trainer", [np.ones((2, 3), np.float32)]))
    >>> request.aggregation.aggregation_id, request.gradients.sequence, len(request.gradients.chunks[0].data)
    ('run-7', 1, 24)
    """
    check_wire_dtype(wire_dtype)
    parts: list = [*_len_field(_STEP_AGGREGATION, aggregation.SerializeToString())]
    if batch is not None:
        chunks = []
        for k, array in enumerate(batch):
            code, nbytes, _, piece = _tensor_source(array, wire_name(array.dtype, wire_dtype), 1 << 62)
            chunks.append(tensor_chunk(k, code, array.shape, 0, piece(0, nbytes)))
        gradients = _submit_parts("", client_id, 1, chunks, writer_id)
        parts += [varint(_STEP_GRADIENTS << 3 | _LEN), varint(sum(_size(p) for p in gradients)), *gradients]
    parts += _len_field(_STEP_PREVIOUS_ID, previous_id.encode())
    return b"".join(parts)


def submit_batch(aggregation_id: str, client_id: str, sequence: int, batch: Sequence[np.ndarray],
                 max_bytes: int, writer_id: str = "", wire_dtype: str | None = None) -> list[bytes]:
    """The serialized SubmitRequests of one batch (one array per layer, batch axis first): its
    tensors packed whole while they fit in ``max_bytes`` of data a message, else cut into chunks.
    All of them at once: :func:`iter_submit_batch` makes them one at a time."""
    return list(iter_submit_batch(aggregation_id, client_id, sequence, batch, max_bytes, writer_id, wire_dtype))


def iter_submit_batch(aggregation_id: str, client_id: str, sequence: int, batch: Sequence[np.ndarray],
                      max_bytes: int, writer_id: str = "", wire_dtype: str | None = None) -> Iterator[bytes]:
    """:func:`submit_batch`'s messages one by one, each made when asked for: a batch of gigabytes is
    never in memory twice (see :func:`encode_batch`)."""
    for message, _ in encode_batch(aggregation_id, client_id, sequence, batch, max_bytes, writer_id, wire_dtype):
        yield message


def encode_batch(aggregation_id: str, client_id: str, sequence: int, batch: Sequence[np.ndarray],
                 max_bytes: int, writer_id: str = "", wire_dtype: str | None = None,
                 start: Sequence[int] | None = None) -> Iterator[tuple[bytes, int]]:
    """Yields each serialized SubmitRequest of one batch with its bytes of tensor data, made when asked for.

    The batch's arrays are read, not copied whole: each message copies its own part of them (once, when it
    is joined), so encoding holds about one message at a time, whatever the batch's size (an array that is
    not C-contiguous is made so first, whole). A big-endian array is swapped piece by piece.

    ``wire_dtype`` None sends each layer in its own dtype. ``"bfloat16"`` or ``"float16"`` sends the
    float32 layers' values in that 16-bit format (:func:`to_wire_dtype`, converted a message's piece at a
    time; other dtypes as they are): the chunks' dtype says so, their shape is still the whole tensor's,
    offsets and data are bytes of the 16-bit encoding and always hold whole elements (a chunk holds one at
    least, 2 bytes, whatever ``max_bytes``).

    ``start``: per layer, the wire bytes the server already holds (a resumed batch, see SubmitRequest.resume):
    each layer is sent from there on, a layer held whole not at all.
    """
    check_wire_dtype(wire_dtype)
    chunks: list = []
    size = 0
    for k, array in enumerate(batch):
        code, nbytes, step, piece = _tensor_source(array, wire_name(array.dtype, wire_dtype), max_bytes)
        first = 0 if start is None else int(start[k])
        if first and first >= nbytes:
            continue  # the server has all of it
        for offset in range(first, max(nbytes, 1), step):
            n = min(step, nbytes - offset)
            if chunks and size + n > max_bytes:
                yield submit_request(aggregation_id, client_id, sequence, chunks, writer_id), size
                chunks, size = [], 0
            chunks.append(tensor_chunk(k, code, array.shape, offset, piece(offset, n)))
            size += n
    if chunks or start is None:
        yield submit_request(aggregation_id, client_id, sequence, chunks, writer_id), size


def _tensor_source(array: np.ndarray, name: str, max_bytes: int):
    """``(dtype code, wire bytes, chunk step, piece(offset, size))`` of one tensor as the wire carries it in
    the dtype ``name``: ``piece`` gives a byte range of its wire bytes, a view where they are the array's."""
    flat = np.ascontiguousarray(array).reshape(-1)  # a view of a C-contiguous array
    if name != flat.dtype.name:  # a float32 tensor in a 16-bit wire format: whole elements, 2 bytes each
        step = max(2, max_bytes - max_bytes % 2)
        return (DTYPES[name], 2 * flat.size, step,
                lambda offset, size: to_wire_dtype(flat[offset // 2 : (offset + size) // 2], name).view(np.uint8))
    little = flat.dtype.newbyteorder("<")
    if flat.dtype == little or flat.dtype.itemsize == 1:
        data = flat.view(np.uint8)
        return dtype_code(flat.dtype), data.size, max(1, max_bytes), lambda offset, size: data[offset : offset + size]
    itemsize = flat.dtype.itemsize

    def swapped(offset: int, size: int) -> np.ndarray:  # the elements under the byte range, little-endian
        first, skip = divmod(offset, itemsize)
        part = flat[first : -(-(offset + size) // itemsize)].astype(little).view(np.uint8)
        return part[skip : skip + size]

    return dtype_code(flat.dtype), flat.size * itemsize, max(1, max_bytes), swapped


# 16-bit wire formats of float32 layers ------------------------------------------------------------
NARROW_DTYPES = ("float16", "bfloat16")  # what a float32 layer's values may be sent as (the client's wire_dtype)


def check_wire_dtype(wire_dtype: str | None) -> str | None:
    """``wire_dtype`` if it is one (None: each layer's own dtype), else a ValueError."""
    if wire_dtype is not None and wire_dtype not in NARROW_DTYPES:
        raise ValueError(f"wire_dtype must be None or one of {list(NARROW_DTYPES)}, got {wire_dtype!r}")
    return wire_dtype


def wire_name(dtype, wire_dtype: str | None) -> str:
    """The wire dtype of a layer of numpy ``dtype`` sent with the client's ``wire_dtype``.

    >>> wire_name(np.float32, "bfloat16"), wire_name(np.float64, "bfloat16"), wire_name(np.float32, None)
    ('bfloat16', 'float64', 'float32')
    """
    name = np.dtype(dtype).name
    return wire_dtype if wire_dtype is not None and name == "float32" else name


def accepts_wire_dtype(layer_dtype: str, name: str) -> bool:
    """Whether a layer of dtype ``layer_dtype`` may come in chunks of the wire dtype ``name`` (its own,
    or a 16-bit format for a float32 layer: then :func:`widen_into` gives its values).

    >>> accepts_wire_dtype("float32", "bfloat16"), accepts_wire_dtype("float64", "float16")
    (True, False)
    """
    return name == layer_dtype or (layer_dtype == "float32" and name in NARROW_DTYPES)


STEP_ANSWER_OVERHEAD = 64 << 10  # bytes of a StepResponse besides its sums (statistics, release, histograms), at most


def step_answer_nbytes(layers: Iterable[tuple[Sequence[int], str]]) -> int:
    """The most bytes a Step's answer takes for layers of these ``(shape, dtype name)``: each layer's sum (in its
    dtype, at least float32's 4 bytes a value) and the rest of the message. Client and server both check it
    against their message limits before anything of the step is done.

    >>> step_answer_nbytes([((10, 3), "float32"), ((3,), "bfloat16")]) - STEP_ANSWER_OVERHEAD
    132
    """
    return STEP_ANSWER_OVERHEAD + sum(math.prod(shape) * max(4, numpy_dtype(dtype).itemsize)
                                      for shape, dtype in layers)


def wire_nbytes(batch: Sequence[np.ndarray], wire_dtype: str | None = None) -> int:
    """The bytes of tensor data a batch takes on the wire (its float32 layers' halved by a 16-bit wire_dtype)."""
    return sum(a.size * (2 if wire_name(a.dtype, wire_dtype) != a.dtype.name else a.dtype.itemsize) for a in batch)


_BLOCK = 1 << 16  # elements a step of the bfloat16 rounding: its temporaries stay small (256 KiB)
_BF16_NAN = np.array([0x7FC0, 0xFFC0], np.uint16)  # the quiet NaN, by sign (as ml_dtypes and XLA round a NaN)


def to_wire_dtype(values: np.ndarray, name: str) -> np.ndarray:
    """The 16-bit wire encoding ``name`` ("float16" or "bfloat16") of float32 ``values`` (a 1-D piece of a
    tensor, a message's worth): a new little-endian array of 2-byte elements (uint16 for bfloat16).

    float16: numpy's ``astype`` (IEEE round to nearest, ties to even). Beyond float16's range (65504)
    a value becomes inf, and such an example is non-finite at the server (its policy then drops,
    zeroes or refuses it); below 6.1e-5 precision drops (subnormals), below 3e-8 values become 0.
    bfloat16 (float32's range, 8 bits of precision): round to nearest, ties to even, on the float32
    bit pattern, subnormals kept, a value beyond bfloat16's largest rounds to inf, NaN stays NaN (the
    quiet NaN of its sign): bit for bit ``ml_dtypes.bfloat16``'s conversion, without needing it.

    >>> to_wire_dtype(np.array([1.0, 1.00390625, 1.01171875, -np.inf], np.float32), "bfloat16")
    array([16256, 16256, 16258, 65408], dtype=uint16)
    """
    values = np.asarray(values, dtype=np.float32).reshape(-1)
    if name == "float16":
        return values.astype("<f2")
    if name != "bfloat16":
        raise ValueError(f"a 16-bit wire dtype is one of {list(NARROW_DTYPES)}, got {name!r}")
    out = np.empty(values.size, "<u2")
    for start in range(0, values.size, _BLOCK):
        part = values[start : start + _BLOCK]
        bits = np.ascontiguousarray(part).view(np.uint32)  # the float32 bit patterns (native ints)
        rounded = bits >> 16
        rounded &= 1  # the last bit kept: a tie rounds to even
        rounded += 0x7FFF
        rounded += bits  # no carry out of 32 bits but for negative NaNs, fixed below
        rounded >>= 16
        out[start : start + part.size] = rounded
        nan = np.isnan(part)
        if nan.any():
            out[start : start + part.size][nan] = _BF16_NAN[np.signbit(part[nan]).view(np.uint8)]
    return out


def widen_into(data, name: str, out: np.ndarray) -> np.ndarray:
    """Decodes 16-bit wire data ``data`` (bytes-like; ``name`` "float16" or "bfloat16") into ``out``, a
    preallocated float32 1-D array of ``len(data) // 2`` elements; returns ``out``. Exact: every 16-bit
    value is a float32 (a NaN stays NaN). One vectorised pass over a view of ``data``, no temporary.

    >>> widen_into(bytes([0x80, 0x3F, 0xC0, 0x7F]), "bfloat16", np.empty(2, np.float32))
    array([ 1., nan], dtype=float32)
    """
    nbytes = memoryview(data).nbytes
    if out.dtype != np.float32 or out.ndim != 1 or nbytes != 2 * out.size:
        raise ValueError(f"{nbytes} bytes of {name} need a 1-D float32 array of {nbytes / 2:g} elements,"
                         f" got {out.dtype} {out.shape}")
    if name == "bfloat16":  # a bfloat16 is the upper half of the float32 of the same value
        np.left_shift(np.frombuffer(data, "<u2"), 16, out=out.view(np.uint32), dtype=np.uint32)
    elif name == "float16":
        np.copyto(out, np.frombuffer(data, "<f2"))
    else:
        raise ValueError(f"a 16-bit wire dtype is one of {list(NARROW_DTYPES)}, got {name!r}")
    return out


class Chunk(NamedTuple):
    layer: int
    dtype: int
    shape: tuple[int, ...]
    offset: int
    data: memoryview


class SubmitMessage(NamedTuple):
    aggregation_id: str
    client_id: str
    sequence: int
    chunks: list[Chunk]
    writer_id: str = ""
    resume: bool = False


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(end, pos + 10)):  # 10 bytes at most: 64 bits
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, i + 1
        shift += 7
    raise ValueError("truncated or overlong varint")


def _fields(buf: memoryview, pos: int, end: int):
    """Yields ``(field, wire_type, value)``: an int (varint), a ``(start, stop)`` span, or None."""
    value: int | tuple[int, int] | None
    while pos < end:
        key, pos = _varint(buf, pos, min(end, pos + 5))  # a tag is a varint of 32 bits at most, as protobuf reads it
        field, wire_type = key >> 3, key & 7
        if field == 0 or key >> 32:
            raise ValueError(f"field number {field}")
        if wire_type == _VARINT:
            value, pos = _varint(buf, pos, end)
        elif wire_type == _LEN:
            size, pos = _varint(buf, pos, end)
            if pos + size > end:
                raise ValueError("truncated length-delimited field")
            value, pos = (pos, pos + size), pos + size
        elif wire_type in (_I64, _I32):
            pos += 8 if wire_type == _I64 else 4
            if pos > end:
                raise ValueError("truncated fixed-width field")
            value = None
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        yield field, wire_type, value


def _chunk(buf: memoryview, start: int, end: int) -> Chunk:
    layer = dtype = offset = 0
    shape: list[int] = []
    data = buf[start:start]
    for field, wire_type, value in _fields(buf, start, end):
        if field == _LAYER and wire_type == _VARINT:
            layer = value & 0xFFFFFFFF
        elif field == _DTYPE and wire_type == _VARINT:
            dtype = value
        elif field == _SHAPE and wire_type == _VARINT:
            shape.append(value)
        elif field == _SHAPE and wire_type == _LEN:  # packed
            pos, stop = value
            while pos < stop:
                dim, pos = _varint(buf, pos, stop)
                shape.append(dim)
        elif field == _OFFSET and wire_type == _VARINT:
            offset = value
        elif field == _DATA and wire_type == _LEN:
            data = buf[value[0] : value[1]]
        elif field in _CHUNK_FIELDS:
            raise ValueError(f"TensorChunk field {field} has wire type {wire_type}")
    return Chunk(layer, dtype, tuple(d - (1 << 64) if d >= 1 << 63 else d for d in shape), offset, data)


def parse_submit_request(message: bytes) -> SubmitMessage:
    """The fields of a serialized SubmitRequest, tensor data as memoryviews of ``message``.

    protobuf's parser copies every ``bytes`` field into a new object; for Submit's payload
    (megabytes a message) that copy would cost more than the rest of the request path. Anything
    that is not a well-formed SubmitRequest raises ValueError (as a protobuf parse error would);
    unknown fields are skipped, as protobuf does.
    """
    return _submit_message(memoryview(message), 0, len(message))


def _submit_message(buf: memoryview, start: int, end: int) -> SubmitMessage:
    texts = {_AGGREGATION_ID: "", _CLIENT_ID: "", _WRITER_ID: ""}
    sequence, resume = 0, False
    chunks = []
    for field, wire_type, value in _fields(buf, start, end):
        if field in texts and wire_type == _LEN:
            texts[field] = str(buf[value[0] : value[1]], "utf-8")
        elif field == _SEQUENCE and wire_type == _VARINT:
            sequence = value
        elif field == _RESUME and wire_type == _VARINT:
            resume = bool(value)
        elif field == _CHUNKS and wire_type == _LEN:
            chunks.append(_chunk(buf, *value))
        elif field in _SUBMIT_FIELDS:
            raise ValueError(f"SubmitRequest field {field} has wire type {wire_type}")
    return SubmitMessage(texts[_AGGREGATION_ID], texts[_CLIENT_ID], sequence, chunks, texts[_WRITER_ID], resume)


class StepMessage(NamedTuple):
    aggregation: pb.CreateAggregationRequest
    gradients: SubmitMessage | None  # None: an empty sample
    previous_id: str = ""


def parse_step_request(message: bytes) -> StepMessage:
    """The fields of a serialized StepRequest, its gradients' tensor data as memoryviews of ``message`` (as
    :func:`parse_submit_request`); the aggregation's spec parsed by protobuf (small). ValueError if malformed."""
    buf = memoryview(message)
    aggregation, gradients, previous = b"", None, ""
    for field, wire_type, value in _fields(buf, 0, len(buf)):
        if field == _STEP_AGGREGATION and wire_type == _LEN:
            aggregation = bytes(buf[value[0] : value[1]])
        elif field == _STEP_GRADIENTS and wire_type == _LEN:
            gradients = _submit_message(buf, *value)
        elif field == _STEP_PREVIOUS_ID and wire_type == _LEN:
            previous = str(buf[value[0] : value[1]], "utf-8")
        elif field in _STEP_FIELDS:
            raise ValueError(f"StepRequest field {field} has wire type {wire_type}")
    try:
        spec = pb.CreateAggregationRequest.FromString(aggregation)
    except Exception as e:  # protobuf's DecodeError
        raise ValueError(f"StepRequest.aggregation: {e}") from None
    return StepMessage(spec, gradients, previous)
