"""Aggregation state on the host: lifecycle, client sequences, snapshots of the statistics.

The device state (the accumulator's pytree) belongs to the worker; everything
here is guarded by the aggregation's condition variable and read by the
servicer and the admin API without touching the device.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
import time
import uuid

import numpy as np

from clipd.engine import RATIO_BUCKETS, ClipAccumulator, ClipPolicy, LayerSpec

from .errors import FailedPrecondition, NotFound, ResourceExhausted


class State(str, enum.Enum):
    WARMING_UP = "warming_up"
    OPEN = "open"
    FINALIZING = "finalizing"
    FINALIZED = "finalized"
    CANCELLED = "cancelled"


@dataclasses.dataclass(frozen=True)
class LayerStats:
    name: str
    bound: float
    clipped: int
    norm_mean: float
    norm_max: float
    norm_histogram: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Stats:
    """A consistent snapshot of one aggregation's counters (host numbers only)."""

    aggregation_id: str
    state: State
    examples: int
    batches: int
    bytes: int
    non_finite: int
    clipped: int  # GLOBAL: examples scaled down; per-layer: layers scaled down, summed
    layers: tuple[LayerStats, ...]
    bucket_upper_bounds: tuple[float, ...]
    example_norm_histogram: tuple[int, ...]
    example_bound: float
    updated_unix_seconds: float
    examples_per_second: float


@dataclasses.dataclass(frozen=True)
class Result:
    stats: Stats
    sums: tuple[np.ndarray, ...]


class Aggregation:
    """One aggregation: its spec, its clients' sequence numbers, its latest statistics."""

    def __init__(self, aggregation_id: str, layers: tuple[LayerSpec, ...], policy: ClipPolicy,
                 reject_non_finite: bool, max_device_rows: int, staging_bytes: int) -> None:
        self.id = aggregation_id
        self.layers = layers
        self.policy = policy
        self.reject_non_finite = reject_non_finite
        self.accumulator = ClipAccumulator(layers, policy)
        self.example_bytes = sum(l.size * np.dtype(l.dtype).itemsize for l in layers)
        rows = max(1, min(max_device_rows, staging_bytes // max(1, self.example_bytes)))
        self.device_rows = 1 << (rows.bit_length() - 1)  # a power of two
        self.created = time.time()
        self.cond = threading.Condition()
        self.state = State.WARMING_UP
        self.pending = 0  # batches accepted and not yet accumulated
        self._accepted: dict[str, int] = {}
        self._accumulated: dict[str, int] = {}
        self._examples = self._batches = self._bytes = 0
        self._device_stats = None  # the last state snapshot without its sums (numpy)
        self._updated = self.created
        self._rates: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self.result: Result | None = None
        self._finalize_lock = threading.Lock()

    @property
    def examples(self) -> int:
        """Examples in the sum so far."""
        return self._examples

    # Clients and sequence numbers -------------------------------------------------
    def accept(self, client_id: str, sequence: int) -> bool:
        """Reserves a batch: True if new, False if a duplicate of an accepted one."""
        with self.cond:
            if self.state not in (State.WARMING_UP, State.OPEN):
                raise FailedPrecondition(f"aggregation {self.id} is {self.state.value}: it takes no more batches")
            last = self._accepted.get(client_id, 0)
            if sequence <= last:
                return False
            if sequence != last + 1:
                raise FailedPrecondition(
                    f"client {client_id!r}: batch {sequence} after {last}; sequence numbers go up by one from 1"
                )
            self._accepted[client_id] = sequence
            self.pending += 1
            return True

    def accumulated(self, client_id: str) -> int:
        with self.cond:
            return self._accumulated.get(client_id, 0)

    # Called by the worker ---------------------------------------------------------
    def record(self, done: list[tuple[str, int, int, int]], device_stats) -> None:
        """Marks ``(client, sequence, rows, nbytes)`` batches as in the sum, with the new statistics."""
        now = time.time()
        with self.cond:
            for client, sequence, rows, nbytes in done:
                self._accumulated[client] = max(self._accumulated.get(client, 0), sequence)
                self._examples += rows
                self._bytes += nbytes
                self._batches += 1
                self.pending -= 1
            if device_stats is not None:
                self._device_stats = device_stats
            self._updated = now
            if not self._rates or now - self._rates[-1][0] >= 0.25:  # 64 samples cover >= 16 s
                self._rates.append((now, self._examples))
            self.cond.notify_all()

    def drop(self, count: int) -> None:
        """Forgets ``count`` accepted batches that will never be accumulated (cancelled)."""
        with self.cond:
            self.pending -= count
            self.cond.notify_all()

    def mark_open(self) -> None:
        with self.cond:
            if self.state is State.WARMING_UP:
                self.state = State.OPEN
            self.cond.notify_all()

    # Lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Stops taking batches; FINALIZING until :meth:`wait_drained` sees the last one summed."""
        with self.cond:
            if self.state is State.CANCELLED:
                raise FailedPrecondition(f"aggregation {self.id} was cancelled")
            if self.state in (State.WARMING_UP, State.OPEN):
                self.state = State.FINALIZING
            self.cond.notify_all()

    def wait_drained(self, timeout: float | None = None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.pending == 0, timeout)

    def finalize(self, read_state) -> Result:
        """Closes, waits for every accepted batch, and keeps ``Result`` (a second call returns it).

        ``read_state()`` returns the final accumulator state (numpy); its statistics
        replace the last snapshot, which may be up to the worker's read period old.
        """
        with self._finalize_lock:
            if self.result is not None:
                return self.result
            self.close()
            self.wait_drained()
            state = read_state()
            with self.cond:
                if self.state is State.CANCELLED:
                    raise FailedPrecondition(f"aggregation {self.id} was cancelled")
                self.state = State.FINALIZED
                self._device_stats = state.statistics_only()
                self.result = Result(self._stats_locked(), tuple(np.asarray(s) for s in state.sums))
                return self.result

    def cancel(self) -> None:
        with self.cond:
            self.state = State.CANCELLED
            self.result = None
            self.cond.notify_all()

    # Reading ------------------------------------------------------------------------
    def stats(self) -> Stats:
        with self.cond:
            return self._stats_locked()

    def _stats_locked(self) -> Stats:
        k = len(self.layers)
        d = self._device_stats
        zeros = np.zeros((k, len(RATIO_BUCKETS) + 1), np.int64)
        clip_counts = d.clip_counts if d is not None else np.zeros(k, np.int64)
        norm_sum = d.norm_sum if d is not None else np.zeros(k)
        norm_max = d.norm_max if d is not None else np.zeros(k)
        hist = d.layer_norm_histogram if d is not None else zeros
        counted = hist.sum(axis=1)
        bounds = self.accumulator.bounds if self.policy.is_per_layer else self.accumulator.bounds * k
        layers = tuple(
            LayerStats(
                name=spec.name,
                bound=float(bounds[i]),
                clipped=int(clip_counts[i]),
                norm_mean=float(norm_sum[i] / counted[i]) if counted[i] else 0.0,
                norm_max=float(norm_max[i]),
                norm_histogram=tuple(int(c) for c in hist[i]),
            )
            for i, spec in enumerate(self.layers)
        )
        clipped = int(clip_counts[0]) if not self.policy.is_per_layer else int(np.sum(clip_counts))
        example_hist = d.example_norm_histogram if d is not None else zeros[0]
        return Stats(
            aggregation_id=self.id,
            state=self.state,
            examples=self._examples,
            batches=self._batches,
            bytes=self._bytes,
            non_finite=int(d.non_finite_count) if d is not None else 0,
            clipped=clipped,
            layers=layers,
            bucket_upper_bounds=RATIO_BUCKETS,
            example_norm_histogram=tuple(int(c) for c in example_hist),
            example_bound=self.policy.example_bound(self.layers),
            updated_unix_seconds=self._updated,
            examples_per_second=self._rate(),
        )

    def _rate(self, window: float = 10.0) -> float:
        """Examples per second over the last ``window`` seconds (0 once idle that long)."""
        now = time.time()
        start = max(self.created, now - window)
        before = [n for t, n in self._rates if t <= start]
        base = before[-1] if before else 0
        return (self._examples - base) / (now - start) if now > start else 0.0


class Registry:
    """The aggregations of one server, by id, with a limit on how many exist at once."""

    def __init__(self, max_aggregations: int) -> None:
        self.max_aggregations = max_aggregations
        self._lock = threading.Lock()
        self._by_id: dict[str, Aggregation] = {}

    def create(self, aggregation_id: str, make) -> tuple[Aggregation, bool]:
        """The aggregation with this id (``make(id)`` builds a new one); True if it was created."""
        with self._lock:
            aggregation_id = aggregation_id or uuid.uuid4().hex
            existing = self._by_id.get(aggregation_id)
            if existing is not None:
                return existing, False
            if len(self._by_id) >= self.max_aggregations:
                raise ResourceExhausted(
                    f"{len(self._by_id)} aggregations exist, the limit is {self.max_aggregations};"
                    " cancel finished ones"
                )
            aggregation = make(aggregation_id)
            self._by_id[aggregation_id] = aggregation
            return aggregation, True

    def get(self, aggregation_id: str) -> Aggregation:
        with self._lock:
            aggregation = self._by_id.get(aggregation_id)
        if aggregation is None:
            raise NotFound(f"no aggregation {aggregation_id!r}")
        return aggregation

    def remove(self, aggregation_id: str) -> Aggregation:
        with self._lock:
            aggregation = self._by_id.pop(aggregation_id, None)
        if aggregation is None:
            raise NotFound(f"no aggregation {aggregation_id!r}")
        return aggregation

    def all(self) -> list[Aggregation]:
        with self._lock:
            return list(self._by_id.values())

