"""Reassembling a batch from its TensorChunk messages, checking it against the layer spec."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from clipd import wire
from clipd.engine import LayerSpec
from clipd.server.errors import InvalidArgument, ResourceExhausted
from clipd.server.rpc.codec import dtype_of
from clipd.server.rpc.limits import ByteBudget, Reservation


ALIGNMENT = 64  # bytes: JAX on the CPU reads host buffers aligned to this in place (others it copies)


def aligned_empty(shape, dtype, alignment: int = ALIGNMENT) -> np.ndarray:
    """An uninitialised array whose data starts on an ``alignment``-byte boundary."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class Batch(NamedTuple):
    """A complete, validated batch: one ``(rows, *shape)`` array per layer.

    ``reservation`` holds its bytes in the server's buffer budget until the
    device worker has copied it (or it is dropped): whoever lets go of a batch
    calls :meth:`release`.
    """

    sequence: int
    rows: int
    layers: list[np.ndarray]
    nbytes: int
    reservation: Reservation | None = None

    def release(self) -> None:
        if self.reservation is not None:
            self.reservation.release()


class _Partial:
    def __init__(self, sequence: int, num_layers: int) -> None:
        self.sequence = sequence
        self.rows: int | None = None
        self.buffers: list[np.ndarray | bytes | None] = [None] * num_layers
        self.received = [0] * num_layers
        self.expected = [0] * num_layers
        self.reservation: Reservation | None = None


class BatchAssembler:
    """Collects the chunks of one client's batches, in order, and returns each batch when complete.

    Each chunk is checked on arrival (layer index, dtype, shape, batch size, byte
    range), so a bad batch is refused before the rest of it is read. A batch
    reserves its whole size in ``budget`` on its first chunk (waiting up to
    ``wait`` seconds for room); :meth:`discard` gives back an incomplete one.
    """

    def __init__(self, layers: tuple[LayerSpec, ...], max_batch_bytes: int,
                 budget: ByteBudget | None = None, wait: float = 0.0) -> None:
        self.layers = layers
        self.max_batch_bytes = max_batch_bytes
        self.budget = budget
        self.wait = wait
        self._partial: _Partial | None = None

    def discard(self) -> None:
        """Drops the incomplete batch, if any, and its reservation."""
        p, self._partial = self._partial, None
        if p is not None:
            if p.reservation is not None:
                p.reservation.release()
            p.buffers = []

    @property
    def incomplete_sequence(self) -> int | None:
        return None if self._partial is None else self._partial.sequence

    def add(self, sequence: int, chunks) -> Batch | None:
        """Adds one message's chunks; returns the batch if this message completed it."""
        p = self._partial
        if p is not None and p.sequence != sequence:
            missing = [self.layers[k].name for k in range(len(self.layers)) if p.received[k] < p.expected[k] or p.buffers[k] is None]
            raise InvalidArgument(
                f"batch {p.sequence} is incomplete (layers {missing} short) but batch {sequence} started"
            )
        if p is None:
            if not chunks:
                raise InvalidArgument(f"batch {sequence}: a message without chunks")
            p = self._partial = _Partial(sequence, len(self.layers))
        for chunk in chunks:
            self._add_chunk(p, chunk)
        if all(b is not None for b in p.buffers) and p.received == p.expected:
            self._partial = None
            layers = [self._as_array(k, p) for k in range(len(self.layers))]
            return Batch(sequence, p.rows, layers, sum(p.expected), p.reservation)
        return None

    def _add_chunk(self, p: _Partial, chunk) -> None:
        if chunk.layer >= len(self.layers):
            raise InvalidArgument(f"batch {p.sequence}: layer index {chunk.layer}, there are {len(self.layers)} layers")
        k, spec = chunk.layer, self.layers[chunk.layer]
        where = f"batch {p.sequence}, layer {spec.name!r}"
        dtype = dtype_of(chunk.dtype, where)
        if str(dtype) != spec.dtype:
            raise InvalidArgument(f"{where}: dtype {dtype}, expected {spec.dtype}")
        shape = tuple(chunk.shape)
        if len(shape) != 1 + len(spec.shape) or shape[1:] != spec.shape or shape[0] < 1:
            raise InvalidArgument(f"{where}: shape {list(shape)}, expected [batch, {', '.join(map(str, spec.shape))}]")
        if p.rows is None:
            p.rows = shape[0]
            p.expected = [p.rows * layer.size * wire.numpy_dtype(layer.dtype).itemsize for layer in self.layers]
            if sum(p.expected) > self.max_batch_bytes:
                raise ResourceExhausted(
                    f"batch {p.sequence}: {sum(p.expected)} bytes, the limit is {self.max_batch_bytes}; send smaller batches"
                )
            if self.budget is not None:
                p.reservation = self.budget.reserve(sum(p.expected), self.wait)
        elif shape[0] != p.rows:
            raise InvalidArgument(f"{where}: batch size {shape[0]}, other layers have {p.rows}")
        if chunk.offset != p.received[k]:
            raise InvalidArgument(f"{where}: chunk at byte {chunk.offset}, expected {p.received[k]} (chunks go in order)")
        end = chunk.offset + len(chunk.data)
        if end > p.expected[k]:
            raise InvalidArgument(
                f"{where}: {end} bytes, expected {p.expected[k]} ({p.rows} x {math.prod(spec.shape)} x {dtype.itemsize})"
            )
        if p.buffers[k] is None and end == p.expected[k]:
            p.buffers[k] = chunk.data  # the whole tensor in one chunk: no copy
        else:
            if p.buffers[k] is None:  # the one copy of a large update: where the device step reads it from
                p.buffers[k] = aligned_empty(p.expected[k], np.uint8)
            p.buffers[k][chunk.offset : end] = np.frombuffer(chunk.data, np.uint8)
        p.received[k] = end

    def _as_array(self, k: int, p: _Partial) -> np.ndarray:
        spec = self.layers[k]
        return wire.as_array(p.buffers[k], spec.dtype, (p.rows, *spec.shape))


