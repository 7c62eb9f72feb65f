"""The host-side partial aggregate: what a checkpoint stores, a shard holds and a merge adds up.

The device accumulates a *delta* in float32 with int32 counters (fast, and
exact enough over a bounded number of steps). The host keeps the totals in
float64 and int64 and adds each delta into them (a "flush"), so the error of
the float32 sum does not grow with the length of the stream and no counter can
wrap. The totals also say which batches they cover: for each client, the
highest sequence number summed and the writer (one submission) that sent it.

A partial state has four verbs, as TFF's ``CheckpointAggregator``:
:meth:`PartialState.absorb` (accumulate a device delta), :meth:`PartialState.merge`
(add another partial state; overlapping clients are refused, so nothing can be
counted twice), :meth:`PartialState.to_bytes` and :meth:`PartialState.from_bytes`
(a self-describing, checksummed blob).

Example:
  >>> import numpy as np
  >>> layers = (LayerSpec("w", (2,)),)
  >>> a = PartialState.empty(layers).absorb_totals(
  ...     sums=[np.array([1.0, 2.0])], examples=3, clients={"alice": (2, "")})
  >>> b = PartialState.empty(layers).absorb_totals(
  ...     sums=[np.array([0.5, 0.5])], examples=1, clients={"bob": (1, "")})
  >>> merged = a.merge(b)
  >>> merged.sums[0], merged.examples, sorted(merged.clients)
  (array([1.5, 2.5]), 4, ['alice', 'bob'])
  >>> PartialState.from_bytes(merged.to_bytes()) == merged
  True
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from ._accumulator import NUM_BUCKETS, AccumulatorState
from ._policy import LayerSpec

MAGIC = b"CLIPDPS1"
_HEAD = struct.Struct("<8sQ")  # magic, header length
_CRC = struct.Struct("<I")


class CorruptStateError(ValueError):
    """A serialized partial state is truncated, corrupted or of another format.

    >>> blob = PartialState.empty([LayerSpec("w", (2,))]).to_bytes()
    >>> PartialState.from_bytes(blob[:-1])
    Traceback (most recent call last):
    ...
    clipd.engine._partial.CorruptStateError: partial state: checksum mismatch (truncated or corrupted)
    """


class OverlapError(ValueError):
    """Two partial states both cover batches of one client: merging them would count those twice.

    >>> a = PartialState.empty([LayerSpec("w", (2,))]).absorb_totals(clients={"alice": (3, "")})
    >>> a.merge(a)
    Traceback (most recent call last):
    ...
    clipd.engine._partial.OverlapError: merge: clients ['alice'] have batches in both partial states
    """


ClientMark = tuple[int, str]  # (highest sequence summed, writer id)


@dataclasses.dataclass(frozen=True, eq=False)
class PartialState:
    """Totals of the batches an aggregation (or one shard of it) has summed. K = number of layers.

    >>> state = PartialState.empty([LayerSpec("w", (2,))])
    >>> state = state.absorb_totals(sums=[[1.0, 2.0]], examples=1, clients={"alice": (1, "")})
    >>> state.sums[0], state.examples, state.clients["alice"]
    (array([1., 2.]), 1, (1, ''))
    """

    layers: tuple[LayerSpec, ...]
    sums: tuple[np.ndarray, ...]  # per layer: float64, the layer's shape
    examples: int  # valid examples seen, non-finite ones included
    non_finite: int
    clip_counts: np.ndarray  # int64 (K,): examples whose layer k was scaled down (GLOBAL: K equal counts)
    layer_histograms: np.ndarray  # int64 (K, NUM_BUCKETS): layer norm / layer bound
    example_histogram: np.ndarray  # int64 (NUM_BUCKETS,): example norm / example bound
    norm_sum: np.ndarray  # float64 (K,): sum of the finite layer norms (for the mean)
    norm_max: np.ndarray  # float64 (K,)
    clients: Mapping[str, ClientMark]  # client id -> (highest sequence summed, writer id)
    batches: int = 0
    bytes: int = 0

    @classmethod
    def empty(cls, layers: Sequence[LayerSpec]) -> PartialState:
        layers = tuple(LayerSpec(*layer) for layer in layers)
        k = len(layers)
        return cls(
            layers=layers,
            sums=tuple(np.zeros(layer.shape, np.float64) for layer in layers),
            examples=0,
            non_finite=0,
            clip_counts=np.zeros(k, np.int64),
            layer_histograms=np.zeros((k, NUM_BUCKETS), np.int64),
            example_histogram=np.zeros(NUM_BUCKETS, np.int64),
            norm_sum=np.zeros(k, np.float64),
            norm_max=np.zeros(k, np.float64),
            clients={},
        )

    # Accumulate -------------------------------------------------------------------------
    def absorb(self, delta: AccumulatorState, clients: Mapping[str, ClientMark] = {},
               batches: int = 0, nbytes: int = 0) -> PartialState:
        """These totals plus a device delta (host numpy arrays) and the batches it covers.

        A statistics-only delta (``delta.sum_chunks is None``, see
        ``AccumulatorState.statistics_only``) leaves the sums as they are: the
        server uses that for live statistics between flushes.
        """
        hist = np.asarray(delta.layer_norm_histogram, np.int64)
        return self.absorb_totals(
            sums=None if delta.sum_chunks is None else [np.asarray(s) for s in delta.sums],
            examples=int(delta.example_count),
            non_finite=int(delta.non_finite_count),
            clip_counts=np.asarray(delta.clip_counts, np.int64),
            layer_histograms=hist,
            example_histogram=np.asarray(delta.example_norm_histogram, np.int64),
            norm_sum=np.asarray(delta.norm_sum, np.float64),
            norm_max=np.asarray(delta.norm_max, np.float64),
            clients=clients, batches=batches, nbytes=nbytes,
        )

    def absorb_totals(self, *, sums=None, examples=0, non_finite=0, clip_counts=0, layer_histograms=0,
                      example_histogram=0, norm_sum=0.0, norm_max=0.0,
                      clients: Mapping[str, ClientMark] = {}, batches=0, nbytes=0) -> PartialState:
        """These totals plus the given ones (each defaults to nothing); the client marks move up."""
        marks = dict(self.clients)
        for client, (sequence, writer) in clients.items():
            if sequence > marks.get(client, (0, ""))[0]:
                marks[client] = (int(sequence), writer)
        return dataclasses.replace(
            self,
            sums=self.sums if sums is None else tuple(
                total + np.asarray(s, np.float64).reshape(total.shape) for total, s in zip(self.sums, sums)
            ),
            examples=self.examples + int(examples),
            non_finite=self.non_finite + int(non_finite),
            clip_counts=self.clip_counts + clip_counts,
            layer_histograms=self.layer_histograms + layer_histograms,
            example_histogram=self.example_histogram + example_histogram,
            norm_sum=self.norm_sum + norm_sum,
            norm_max=np.maximum(self.norm_max, norm_max),
            clients=marks,
            batches=self.batches + int(batches),
            bytes=self.bytes + int(nbytes),
        )

    def merge(self, other: PartialState) -> PartialState:
        """The totals of two partial states of one aggregation that cover different clients.

        Raises ``OverlapError`` when a client has batches in both (its batches
        would be counted twice) and ``ValueError`` when the layers differ.
        """
        if self.layers != other.layers:
            raise ValueError(f"merge: the layers differ ({self.layers} and {other.layers})")
        both = sorted(set(self.clients) & set(other.clients))
        if both:
            raise OverlapError(f"merge: clients {both[:5]} have batches in both partial states")
        return self.absorb_totals(
            sums=other.sums, examples=other.examples, non_finite=other.non_finite,
            clip_counts=other.clip_counts, layer_histograms=other.layer_histograms,
            example_histogram=other.example_histogram, norm_sum=other.norm_sum, norm_max=other.norm_max,
            clients=other.clients, batches=other.batches, nbytes=other.bytes,
        )

    @staticmethod
    def merge_all(states: Sequence[PartialState]) -> PartialState:
        """The merge of one or more partial states (the shards of an aggregation), in order.

        >>> layers = [LayerSpec("w", (1,))]
        >>> shards = [PartialState.empty(layers).absorb_totals(sums=[[float(k)]], clients={f"c{k}": (1, "")})
        ...           for k in range(3)]
        >>> merged = PartialState.merge_all(shards)
        >>> merged.sums[0], sorted(merged.clients)
        (array([3.]), ['c0', 'c1', 'c2'])
        """
        return functools.reduce(PartialState.merge, states)

    # Serialize ----------------------------------------------------------------------------
    def _arrays(self) -> list[tuple[str, np.ndarray]]:
        return [*((f"sums/{k}", s) for k, s in enumerate(self.sums)),
                ("clip_counts", self.clip_counts), ("layer_histograms", self.layer_histograms),
                ("example_histogram", self.example_histogram), ("norm_sum", self.norm_sum),
                ("norm_max", self.norm_max)]

    def to_bytes(self) -> bytes:
        """A self-describing blob: magic, a JSON header, the raw little-endian arrays, a CRC-32 of it all."""
        arrays = [(name, np.ascontiguousarray(a, a.dtype.newbyteorder("<"))) for name, a in self._arrays()]
        header = json.dumps({
            "layers": [[l.name, list(l.shape), l.dtype] for l in self.layers],
            "examples": self.examples, "non_finite": self.non_finite,
            "batches": self.batches, "bytes": self.bytes,
            "clients": {c: [s, w] for c, (s, w) in sorted(self.clients.items())},
            "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in arrays],
        }, separators=(",", ":")).encode()
        parts = [_HEAD.pack(MAGIC, len(header)), header, *(memoryview(a).cast("B") for _, a in arrays)]
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        return b"".join([*parts, _CRC.pack(crc)])

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> PartialState:
        """Reads :meth:`to_bytes`'s blob; ``CorruptStateError`` if it is truncated or altered."""
        data = memoryview(data).cast("B")
        if len(data) < _HEAD.size + _CRC.size:
            raise CorruptStateError(f"partial state: {len(data)} bytes is too short")
        (crc,) = _CRC.unpack(data[-_CRC.size:])
        if zlib.crc32(data[: -_CRC.size]) != crc:
            raise CorruptStateError("partial state: checksum mismatch (truncated or corrupted)")
        magic, header_len = _HEAD.unpack(data[: _HEAD.size])
        if magic != MAGIC:
            raise CorruptStateError(f"partial state: unknown format {bytes(magic)!r}")
        try:
            header = json.loads(bytes(data[_HEAD.size : _HEAD.size + header_len]))
            offset = _HEAD.size + header_len
            arrays = {}
            for name, dtype, shape in header["arrays"]:
                dtype = np.dtype(dtype)
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                arrays[name] = np.frombuffer(data[offset : offset + nbytes], dtype).reshape(shape).astype(
                    dtype.newbyteorder("="))
                offset += nbytes
            if offset != len(data) - _CRC.size:
                raise CorruptStateError("partial state: the arrays do not fill the blob")
            layers = tuple(LayerSpec(n, tuple(s), d) for n, s, d in header["layers"])
            return cls(
                layers=layers,
                sums=tuple(arrays[f"sums/{k}"] for k in range(len(layers))),
                examples=header["examples"], non_finite=header["non_finite"],
                clip_counts=arrays["clip_counts"], layer_histograms=arrays["layer_histograms"],
                example_histogram=arrays["example_histogram"], norm_sum=arrays["norm_sum"],
                norm_max=arrays["norm_max"],
                clients={c: (int(s), str(w)) for c, (s, w) in header["clients"].items()},
                batches=header["batches"], bytes=header["bytes"],
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CorruptStateError):
                raise
            raise CorruptStateError(f"partial state: malformed header ({e})") from None

    def __eq__(self, other: object) -> bool:
        """Equal totals, exactly (arrays compared bit for bit)."""
        if not isinstance(other, PartialState):
            return NotImplemented
        mine, theirs = self._arrays(), other._arrays()
        return (
            (self.layers, self.examples, self.non_finite, dict(self.clients), self.batches, self.bytes)
            == (other.layers, other.examples, other.non_finite, dict(other.clients), other.batches, other.bytes)
            and len(mine) == len(theirs)
            and all(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
                    for (_, a), (_, b) in zip(mine, theirs))
        )

    __hash__ = None  # mutable arrays inside
