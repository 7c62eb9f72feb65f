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
counted twice), :meth:`PartialState.write_to` and :meth:`PartialState.read_from`
(a self-describing, checksummed format, streamed from and into the arrays' own buffers;
:meth:`PartialState.to_bytes` and :meth:`PartialState.from_bytes` hold it in one ``bytes``).

A large model's totals are gigabytes: a flush adds the delta into them in place
(``absorb(..., in_place=True)``: no new float64 array) and a checkpoint streams
them to a file with a running CRC-32 (no whole-state byte string).

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

import builtins
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import BinaryIO

import numpy as np

from . import _container
from ._accumulator import NUM_BUCKETS, AccumulatorState
from ._container import CorruptStateError
from ._policy import LayerSpec

MAGIC = b"CLIPDPS1"  # a checkpoint in clipd's container format (_container)


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
    def empty(cls, layers: Sequence[LayerSpec], sums: Sequence[np.ndarray] | None = None) -> PartialState:
        """No examples yet; ``sums``: float64 arrays of the layers' shapes to hold the sums (zeroed by the caller
        before anything is added: a round's totals in the last round's pages), else new zeros."""
        layers = tuple(LayerSpec(*layer) for layer in layers)
        k = len(layers)
        return cls(
            layers=layers,
            sums=tuple(sums) if sums is not None else tuple(np.zeros(layer.shape, np.float64) for layer in layers),
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
               batches: int = 0, nbytes: int = 0, in_place: bool = False) -> PartialState:
        """These totals plus a device delta (host numpy arrays) and the batches it covers.

        A statistics-only delta (``delta.sum_chunks is None``, see
        ``AccumulatorState.statistics_only``) leaves the sums as they are: the
        server uses that for live statistics between flushes. ``in_place``: see
        :meth:`absorb_totals`.
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
            clients=clients, batches=batches, nbytes=nbytes, in_place=in_place,
        )

    def absorb_totals(self, *, sums=None, examples=0, non_finite=0, clip_counts=0, layer_histograms=0,
                      example_histogram=0, norm_sum=0.0, norm_max=0.0,
                      clients: Mapping[str, ClientMark] = {}, batches=0, nbytes=0,
                      in_place: bool = False) -> PartialState:
        """These totals plus the given ones (each defaults to nothing); the client marks move up.

        ``in_place``: the sums are added into this state's own arrays, which the
        returned state shares (no new array the size of the model); this state's
        sums then no longer match its counts, so its owner must drop it (the
        server's device worker, which never flushes while a checkpoint of the
        same arrays is being written).

        >>> state = PartialState.empty([LayerSpec("w", (2,))])
        >>> after = state.absorb_totals(sums=[np.array([1.0, 2.0], np.float32)], examples=1, in_place=True)
        >>> after.sums[0] is state.sums[0], after.sums[0], after.examples
        (True, array([1., 2.]), 1)
        """
        marks = dict(self.clients)
        for client, (sequence, writer) in clients.items():
            if sequence > marks.get(client, (0, ""))[0]:
                marks[client] = (int(sequence), writer)
        return dataclasses.replace(
            self,
            sums=self.sums if sums is None else _add_sums(self.sums, sums, in_place),
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

    def without_sums(self) -> PartialState:
        """The same counts, statistics and client marks with no sums (what a finished aggregation keeps once its
        result is made: a large model's float64 sums are twice the result)."""
        return dataclasses.replace(self, sums=tuple(np.zeros((0,)) for _ in self.sums))

    def merge(self, other: PartialState, with_sums: bool = True) -> PartialState:
        """The totals of two partial states of one aggregation that cover different clients.

        Raises ``OverlapError`` when a client has batches in both (its batches
        would be counted twice) and ``ValueError`` when the layers differ.
        ``with_sums=False`` adds the counts and statistics only (this state's sums
        are kept as they are): what a statistics read needs, without a copy of the model.
        """
        if self.layers != other.layers:
            raise ValueError(f"merge: the layers differ ({self.layers} and {other.layers})")
        both = sorted(set(self.clients) & set(other.clients))
        if both:
            raise OverlapError(f"merge: clients {both[:5]} have batches in both partial states")
        return self.absorb_totals(
            sums=other.sums if with_sums else None, examples=other.examples, non_finite=other.non_finite,
            clip_counts=other.clip_counts, layer_histograms=other.layer_histograms,
            example_histogram=other.example_histogram, norm_sum=other.norm_sum, norm_max=other.norm_max,
            clients=other.clients, batches=other.batches, nbytes=other.bytes,
        )

    @staticmethod
    def merge_all(states: Sequence[PartialState], with_sums: bool = True) -> PartialState:
        """The merge of one or more partial states (the shards of an aggregation), in order.

        >>> layers = [LayerSpec("w", (1,))]
        >>> shards = [PartialState.empty(layers).absorb_totals(sums=[[float(k)]], clients={f"c{k}": (1, "")})
        ...           for k in range(3)]
        >>> merged = PartialState.merge_all(shards)
        >>> merged.sums[0], sorted(merged.clients)
        (array([3.]), ['c0', 'c1', 'c2'])
        """
        return functools.reduce(lambda a, b: a.merge(b, with_sums), states)

    # Serialize ----------------------------------------------------------------------------
    @property
    def array_bytes(self) -> int:
        """Bytes of its arrays: about what :meth:`write_to` writes (a JSON header and 20 bytes more)."""
        return sum(array.nbytes for _, array in self._arrays())

    def _arrays(self) -> list[tuple[str, np.ndarray]]:
        return [*((f"sums/{k}", s) for k, s in enumerate(self.sums)),
                ("clip_counts", self.clip_counts), ("layer_histograms", self.layer_histograms),
                ("example_histogram", self.example_histogram), ("norm_sum", self.norm_sum),
                ("norm_max", self.norm_max)]

    def write_to(self, file: BinaryIO) -> tuple[int, int]:
        """Writes the state in clipd's container format (``_container``: magic ``CLIPDPS1``, a JSON header,
        the raw little-endian arrays from their own buffers, a CRC-32 of it all). Returns ``(bytes written,
        CRC-32 of the whole)``, what a store keeps beside the file."""
        return _container.write(file, MAGIC, self._fields(), self._arrays())

    def _fields(self) -> dict:
        return {
            "layers": [[layer.name, list(layer.shape), layer.dtype] for layer in self.layers],
            "examples": self.examples, "non_finite": self.non_finite,
            "batches": self.batches, "bytes": self.bytes,
            "clients": dict(sorted(self.clients.items())),  # {client: (sequence, writer)}: JSON's [s, w]
        }

    def to_bytes(self) -> builtins.bytes:  # builtins: the field `bytes` shadows the type in this class
        """:meth:`write_to`'s format in one ``bytes`` (a store that keeps blobs in a database row)."""
        return _container.to_bytes(MAGIC, self._fields(), self._arrays())

    @classmethod
    def from_bytes(cls, data: builtins.bytes | memoryview) -> PartialState:
        """Reads :meth:`to_bytes`'s blob; ``CorruptStateError`` if it is truncated or altered.

        >>> blob = PartialState.empty([LayerSpec("w", (2,))]).to_bytes()
        >>> PartialState.from_bytes(blob[:-1])
        Traceback (most recent call last):
        ...
        clipd.engine._container.CorruptStateError: partial state: checksum mismatch (truncated or corrupted)
        """
        return cls._from_container(*_container.from_bytes(data, MAGIC, "partial state"))

    @classmethod
    def read_from(cls, file: _container.BinaryReader, nbytes: int, crc32: int | None = None) -> PartialState:
        """Reads :meth:`write_to`'s ``nbytes`` bytes from ``file`` into new arrays, a piece at a time.

        ``CorruptStateError`` if they are truncated, altered or of another format:
        the state's own CRC-32 is checked, and ``crc32`` (what :meth:`write_to`
        returned, kept by a store) when given, before the state is returned.
        """
        return cls._from_container(*_container.read(file, nbytes, MAGIC, "partial state", crc32))

    @classmethod
    def _from_container(cls, header: dict, arrays: dict) -> PartialState:
        try:
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

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside: unhashable (typeshed's idiom too)


def _add_sums(totals: tuple[np.ndarray, ...], sums, in_place: bool) -> tuple[np.ndarray, ...]:
    """``totals + sums`` per layer in float64: into ``totals`` themselves when ``in_place``, else new arrays."""
    out = []
    for total, s in zip(totals, sums):
        s = np.asarray(s).reshape(total.shape)
        if in_place:
            np.add(total, s, out=total)  # float32 into float64: numpy casts in small pieces, no temporary
            out.append(total)
        else:
            out.append(total + s.astype(np.float64))
    return tuple(out)
