"""Reassembling a batch from its TensorChunk messages, checking it against the layer spec."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from clipd import wire
from clipd.engine import LayerSpec
from clipd.server.errors import InvalidArgument, ResourceExhausted
from clipd.server.rpc.codec import dtype_of
from clipd.server.summing.batch import Batch
from clipd.server.summing.memory import ByteBudget, Reservation, aligned_empty


class _Partial:
    def __init__(self, sequence: int, num_layers: int) -> None:
        self.sequence = sequence
        self.rows: int | None = None
        self.buffers: list[np.ndarray | bytes | None] = [None] * num_layers
        self.received = [0] * num_layers  # wire bytes of each layer received so far
        self.expected = [0] * num_layers  # bytes of each layer in its own dtype (what the server holds)
        self.wire: list[str | None] = [None] * num_layers  # each layer's dtype on the wire (its first chunk's)
        self.reservation: Reservation | None = None

    def wire_bytes(self, k: int, spec: LayerSpec) -> int:
        """Bytes layer ``k`` takes on the wire (16-bit values of a float32 layer: half its bytes)."""
        if self.wire[k] is None or self.wire[k] == spec.dtype:
            return self.expected[k]
        return self.expected[k] // np.dtype(spec.dtype).itemsize * 2


class BatchAssembler:
    """Collects the chunks of one client's batches, in order, and returns each batch when complete.

    Each chunk is checked on arrival (layer index, dtype, shape, batch size, byte
    range), so a bad batch is refused before the rest of it is read. A batch
    reserves its whole size in ``budget`` on its first chunk (waiting up to
    ``wait`` seconds for room); :meth:`discard` gives back an incomplete one.
    A batch larger than one message is received straight into one 64-byte-aligned
    buffer per layer, the one copy the server holds of it (the device step reads
    it in place). A float32 layer may arrive as bfloat16 or float16 (half the
    bytes on the wire): its chunks are widened into that buffer as they come.
    """

    def __init__(self, layers: tuple[LayerSpec, ...], max_batch_bytes: int,
                 budget: ByteBudget | None = None, wait: float = 0.0, large_bytes: int = 1 << 62,
                 large_wait: float = 0.0, warmed: Callable[[float], object] | None = None) -> None:
        self.layers = layers
        self.warmed = warmed  # waits (up to its argument, s) for the aggregation's prepared receive buffers
        self.max_batch_bytes = max_batch_bytes  # 0: no limit of its own (the budget's)
        self.budget = budget
        self.wait = wait  # seconds a batch waits for room in the budget...
        self.large_bytes, self.large_wait = large_bytes, large_wait  # ...and one larger than large_bytes
        self.waiting_for_room = False  # a batch is waiting for room now
        self._partial: _Partial | None = None

    def discard(self) -> None:
        """Drops the incomplete batch, if any, and its reservation."""
        p, self._partial = self._partial, None
        if p is not None:
            p.buffers = []
            if p.reservation is not None:
                p.reservation.give_back(reuse=False)

    def take_partial(self) -> _Partial | None:
        """Detaches the incomplete batch (its buffers and reservation with it), for a resuming stream."""
        p, self._partial = self._partial, None
        return p

    def adopt(self, partial: _Partial) -> None:
        """Goes on with a batch another stream of the same writer received in part (:meth:`take_partial`)."""
        self.discard()
        self._partial = partial

    @property
    def incomplete_sequence(self) -> int | None:
        return None if self._partial is None else self._partial.sequence

    @property
    def incomplete_bytes(self) -> int:
        """Wire bytes received of the incomplete batch (0 without one)."""
        p = self._partial
        return 0 if p is None else sum(p.received)

    def add(self, sequence: int, chunks) -> Batch | None:
        """Adds one message's chunks; returns the batch if this message completed it."""
        p = self._partial
        if p is not None and p.sequence != sequence:
            missing = [self.layers[k].name for k in range(len(self.layers))
                       if p.buffers[k] is None or p.received[k] < p.wire_bytes(k, self.layers[k])]
            raise InvalidArgument(
                f"batch {p.sequence} is incomplete (layers {missing} short) but batch {sequence} started"
            )
        if p is None:
            if not chunks:
                raise InvalidArgument(f"batch {sequence}: a message without chunks")
            p = self._partial = _Partial(sequence, len(self.layers))
        for chunk in chunks:
            self._add_chunk(p, chunk)
        if all(b is not None and r == p.wire_bytes(k, spec)
               for k, (b, r, spec) in enumerate(zip(p.buffers, p.received, self.layers))):
            self._partial = None
            assert p.rows is not None  # set by the batch's first chunk
            layers = [self._as_array(k, p) for k in range(len(self.layers))]
            return Batch(sequence, p.rows, layers, sum(p.expected), p.reservation)
        return None

    def _admit(self, p: _Partial) -> None:
        """The batch's size is known (its first chunk): refused if it can never fit, else its bytes reserved."""
        assert p.rows is not None  # _add_chunk sets it before it admits the batch
        nbytes = sum(p.expected)
        what = f"batch {p.sequence}: " + (f"one example of {nbytes} bytes" if p.rows == 1 else f"{nbytes} bytes")
        advice = ("; send smaller batches" if p.rows > 1 else
                  "; an example can't be split: the server must be given more memory")
        if self.max_batch_bytes and nbytes > self.max_batch_bytes:
            raise ResourceExhausted(f"{what}, the limit is {self.max_batch_bytes} (max_batch_bytes){advice}")
        if self.budget is None:
            return
        limit = self.budget.limit
        if nbytes > limit:
            raise ResourceExhausted(f"{what}, more than the {limit} bytes this server can buffer for updates in"
                                    f" flight (max_buffered_bytes, or what memory_budget leaves beside the open"
                                    f" aggregations' sums){advice}")
        # A batch that spans messages (a large update) waits for room as long as a stream may be silent: it
        # can't be sent smaller, and the stream is not idle meanwhile (the server is the one that waits).
        wait = self.wait if nbytes <= self.large_bytes else max(self.wait, self.large_wait)
        self.waiting_for_room = True  # (the server is the one that waits: the stream is not idle)
        try:
            if nbytes > self.large_bytes and self.warmed is not None:
                self.warmed(wait)  # an update that arrives while its aggregation warms up takes a prepared buffer
            p.reservation = self.budget.reserve(nbytes, wait)
        finally:
            self.waiting_for_room = False

    @staticmethod
    def _buffer(p: _Partial, k: int) -> np.ndarray:
        """Layer ``k``'s receive buffer: from the budget's pool (given back with the batch), else a new one."""
        if p.reservation is not None:
            return p.reservation.buffer(p.expected[k])
        return aligned_empty(p.expected[k])

    def _add_chunk(self, p: _Partial, chunk) -> None:
        if chunk.layer >= len(self.layers):
            raise InvalidArgument(f"batch {p.sequence}: layer index {chunk.layer}, there are {len(self.layers)} layers")
        k, spec = chunk.layer, self.layers[chunk.layer]
        where = f"batch {p.sequence}, layer {spec.name!r}"
        dtype = dtype_of(chunk.dtype, where)
        name = wire.DTYPE_NAMES[chunk.dtype]
        if not wire.accepts_wire_dtype(spec.dtype, name):
            raise InvalidArgument(f"{where}: dtype {dtype}, expected {spec.dtype}"
                                  + (" (or bfloat16, float16 on the wire)" if spec.dtype == "float32" else ""))
        if p.wire[k] is not None and p.wire[k] != name:
            raise InvalidArgument(f"{where}: dtype {name}, its earlier chunks were {p.wire[k]}")
        shape = tuple(chunk.shape)
        if len(shape) != 1 + len(spec.shape) or shape[1:] != spec.shape or shape[0] < 1:
            raise InvalidArgument(f"{where}: shape {list(shape)}, expected [batch, {', '.join(map(str, spec.shape))}]")
        if p.rows is None:
            p.rows = shape[0]
            p.expected = [p.rows * layer.size * wire.numpy_dtype(layer.dtype).itemsize for layer in self.layers]
            self._admit(p)
        elif shape[0] != p.rows:
            raise InvalidArgument(f"{where}: batch size {shape[0]}, other layers have {p.rows}")
        p.wire[k] = name
        if chunk.offset != p.received[k]:
            raise InvalidArgument(f"{where}: chunk at byte {chunk.offset}, expected {p.received[k]}"
                                  " (chunks go in order)")
        end = chunk.offset + len(chunk.data)
        total = p.wire_bytes(k, spec)
        if end > total:
            raise InvalidArgument(
                f"{where}: {end} bytes, expected {total} ({p.rows} x {math.prod(spec.shape)} x {dtype.itemsize})"
            )
        if name != spec.dtype:  # 16-bit values of a float32 layer: widened into its buffer
            if chunk.offset % 2 or len(chunk.data) % 2:
                raise InvalidArgument(f"{where}: a {name} chunk covers whole 2-byte values (offset {chunk.offset},"
                                      f" {len(chunk.data)} bytes)")
            if p.buffers[k] is None:
                p.buffers[k] = self._buffer(p, k)
            out = p.buffers[k].view(np.float32)[chunk.offset // 2 : end // 2]
            wire.widen_into(chunk.data, name, out)
        elif p.buffers[k] is None and end == total:
            p.buffers[k] = chunk.data  # the whole tensor in one chunk: no copy
        else:
            if p.buffers[k] is None:  # the one copy of a large update: where the device step reads it from
                p.buffers[k] = self._buffer(p, k)
            p.buffers[k][chunk.offset : end] = np.frombuffer(chunk.data, np.uint8)
        p.received[k] = end

    def _as_array(self, k: int, p: _Partial) -> np.ndarray:
        spec = self.layers[k]
        assert p.rows is not None  # a complete batch's (set by its first chunk)
        return wire.as_array(p.buffers[k], spec.dtype, (p.rows, *spec.shape))


