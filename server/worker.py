"""The device worker: the one thread that owns the JAX device state of every aggregation.

Validated batches wait in a queue bounded in bytes (a full queue makes the
streams wait: back-pressure). The worker packs consecutive batches of one
aggregation into a 64-byte-aligned host staging buffer of ``device_rows`` rows,
hands it to JAX with ``jax.device_put`` (zero-copy on the CPU) padded to the
next bucket size (so each layer spec compiles a handful of programs once, at
warm-up), and runs one jitted accumulator step. Steps are asynchronous: while
the device sums one buffer, the worker copies the next batches into the
aggregation's other buffer. A batch is acknowledged once the step that holds
its last row has finished. The statistics are read back from the device at
most every ``STATS_PERIOD`` while batches keep coming, and whenever the queue
runs empty.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from .aggregations import Aggregation, State
from .batches import Batch
from .errors import Unavailable

log = logging.getLogger(__name__)
STATS_PERIOD = 0.1  # seconds between reads of the device statistics while batches keep coming
FILL_WAIT = 0.002  # how long a step less than half full waits for more batches (seconds)


def aligned_empty(shape: tuple[int, ...], dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an ``alignment``-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def bucket_sizes(device_rows: int) -> list[int]:
    """The padded batch sizes compiled for an aggregation: 1, 4, 16, ..., and ``device_rows``.

    Powers of 4, not 2: each size costs about a second of compilation on these
    CPUs, and under load the worker fills whole ``device_rows`` steps anyway.
    """
    return sorted({4**i for i in range(16) if 4**i < device_rows} | {device_rows})


def bucket_for(rows: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= rows)


@dataclasses.dataclass
class _Work:
    aggregation: Aggregation
    client: str
    batch: Batch


@dataclasses.dataclass
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


class _Stop:
    pass


@dataclasses.dataclass
class _InFlight:
    aggregation: Aggregation
    done: list[tuple[str, int, int, int]]


class DeviceWorker:
    """Runs every device step of the server, in one thread."""

    def __init__(self, max_queued_bytes: int) -> None:
        self.max_queued_bytes = max_queued_bytes
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._stopping = False
        self._states: dict[str, Any] = {}  # aggregation id -> AccumulatorState (device)
        self._staging: dict[str, list[list[np.ndarray]]] = {}
        self._slot: dict[str, int] = {}
        self._stats_read: dict[str, float] = {}  # when each aggregation's statistics were last read
        self._inflight: _InFlight | None = None
        self.device_kind = jax.devices()[0].device_kind
        self.ready = threading.Event()  # set once the device has run a first program
        self._thread = threading.Thread(target=self._run, name="clipd-device-worker", daemon=True)
        self._thread.start()

    # Producer side (gRPC handler threads) -----------------------------------------
    def submit(self, aggregation: Aggregation, client: str, batch: Batch) -> None:
        """Queues an accepted batch; waits while the queue is over its byte budget."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._stopping
                or self._queued_bytes == 0
                or self._queued_bytes + batch.nbytes <= self.max_queued_bytes
            )
            if self._stopping:
                raise Unavailable("the server is shutting down")
            self._queue.append(_Work(aggregation, client, batch))
            self._queued_bytes += batch.nbytes
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Runs ``fn`` on the worker thread, after everything queued before it, and returns its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._queue.append(_Call(fn, future))
            self._cond.notify_all()
        return future.result(timeout)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def warm_up(self, aggregation: Aggregation) -> None:
        """Queues the compilation of every bucket size of ``aggregation``; it opens when done."""
        with self._cond:
            self._queue.append(_Call(lambda: self._warm_up(aggregation), concurrent.futures.Future()))
            self._cond.notify_all()

    def read(self, aggregation: Aggregation):
        """The full state of an aggregation (numpy), once everything queued before has run."""
        return self.call(lambda: jax.device_get(self._states[aggregation.id]))

    def forget(self, aggregation: Aggregation) -> None:
        """Frees an aggregation's device state and staging buffers."""
        self.call(lambda: self._forget(aggregation.id))

    def stop(self, timeout: float | None = None) -> None:
        """Finishes everything queued, then stops the thread."""
        with self._cond:
            self._queue.append(_Stop())
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # The worker thread ----------------------------------------------------------------
    def _take(self, block: bool):
        with self._cond:
            if not self._queue and not block:
                return None
            self._cond.wait_for(lambda: bool(self._queue))
            item = self._queue.popleft()
            if isinstance(item, _Work):
                self._queued_bytes -= item.batch.nbytes
                self._cond.notify_all()
            return item

    def _more_for(self, aggregation: Aggregation, rows: int, deadline: float = 0.0) -> _Work | None:
        """The next queued batch if it belongs to ``aggregation`` and fits in ``rows`` more rows.

        With an empty queue it waits until ``deadline`` (``time.monotonic()``) for one to arrive.
        """
        with self._cond:
            if not self._queue and deadline > time.monotonic():
                self._cond.wait(deadline - time.monotonic())
            if self._queue:
                head = self._queue[0]
                if isinstance(head, _Work) and head.aggregation is aggregation and head.batch.rows <= rows:
                    self._queue.popleft()
                    self._queued_bytes -= head.batch.nbytes
                    self._cond.notify_all()
                    return head
        return None

    def _run(self) -> None:
        jax.block_until_ready(jax.jit(lambda x: x + 1)(np.zeros(8, np.float32)))
        self.ready.set()
        while True:
            item = self._take(block=self._inflight is None)
            try:
                if item is None:
                    self._finish_inflight()
                elif isinstance(item, _Work):
                    self._accumulate(item)
                elif isinstance(item, _Call):
                    self._finish_inflight()
                    self._run_call(item)
                else:
                    self._finish_inflight()
                    return
            except Exception:  # a bug, not bad input (that is refused before the queue)
                log.exception("device worker step failed")

    @staticmethod
    def _run_call(item: _Call) -> None:
        try:
            item.future.set_result(item.fn())
        except Exception as e:  # handed to the caller
            item.future.set_exception(e)

    def _accumulate(self, first: _Work) -> None:
        aggregation = first.aggregation
        if aggregation.state is State.CANCELLED or aggregation.id not in self._states:
            aggregation.drop(1)
            return
        capacity = aggregation.device_rows
        buffers = self._buffers(aggregation)
        fill, done = 0, []
        deadline = time.monotonic() + FILL_WAIT  # small batches arriving one by one fill a step
        work: _Work | None = first
        while work is not None:
            batch, start = work.batch, 0
            while start < batch.rows:
                take = min(batch.rows - start, capacity - fill)
                for buf, layer in zip(buffers, batch.layers):
                    buf[fill : fill + take] = layer[start : start + take]
                fill, start = fill + take, start + take
                if fill == capacity and start < batch.rows:  # a batch larger than one step
                    self._dispatch(aggregation, buffers, fill, done)
                    buffers, fill, done = self._buffers(aggregation), 0, []
            done.append((work.client, batch.sequence, batch.rows, batch.nbytes))
            work = self._more_for(aggregation, capacity - fill, deadline if fill < capacity // 2 else 0.0)
        self._dispatch(aggregation, buffers, fill, done)

    def _buffers(self, aggregation: Aggregation) -> list[np.ndarray]:
        """The aggregation's staging buffer not used by the step in flight."""
        if aggregation.id not in self._staging:
            self._staging[aggregation.id] = [
                [aligned_empty((aggregation.device_rows, *l.shape), l.dtype) for l in aggregation.layers]
                for _ in range(2)
            ]
            self._slot[aggregation.id] = 0
        slot = self._slot[aggregation.id]
        self._slot[aggregation.id] = 1 - slot
        return self._staging[aggregation.id][slot]

    def _dispatch(self, aggregation: Aggregation, buffers, rows: int, done) -> None:
        bucket = bucket_for(rows, bucket_sizes(aggregation.device_rows))
        # Aligned numpy views go to the jitted step as they are: on the CPU JAX reads them in
        # place (one jax.device_put per array costs more than the step for small batches).
        layers = [buf[:bucket] for buf in buffers]
        valid = np.arange(bucket) < rows
        self._finish_inflight()
        state = self._states[aggregation.id]
        self._states[aggregation.id] = aggregation.accumulator.update(state, layers, valid)
        self._inflight = _InFlight(aggregation, done)

    def _finish_inflight(self) -> None:
        """Waits for the step in flight and publishes its batches and statistics."""
        if self._inflight is None:
            return
        inflight, self._inflight = self._inflight, None
        state = self._states[inflight.aggregation.id]
        now = time.monotonic()
        if now - self._stats_read.get(inflight.aggregation.id, 0.0) >= STATS_PERIOD or not self._queue:
            stats = jax.device_get(state.statistics_only())  # waits for the step
            self._stats_read[inflight.aggregation.id] = now
        else:
            stats = None
            jax.block_until_ready(state.stats)
        inflight.aggregation.record(inflight.done, stats)

    def _warm_up(self, aggregation: Aggregation) -> None:
        acc = aggregation.accumulator
        for bucket in bucket_sizes(aggregation.device_rows):
            layers = [np.zeros((bucket, *l.shape), l.dtype) for l in aggregation.layers]
            jax.block_until_ready(acc.update(acc.init(), layers, np.zeros(bucket, bool)))
        self._states[aggregation.id] = acc.init()
        aggregation.mark_open()

    def _forget(self, aggregation_id: str) -> None:
        self._states.pop(aggregation_id, None)
        self._staging.pop(aggregation_id, None)
        self._slot.pop(aggregation_id, None)
        self._stats_read.pop(aggregation_id, None)
