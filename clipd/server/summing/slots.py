"""A shard on its device worker: the device delta, what it covers, and the add of the delta into the totals.

The device holds a *delta* (float32 sums, int32 counts; statistics only, for a large model on the CPU) since the
last flush. A step's batches are counted into the slot once the step is done (:meth:`ShardSlot.count`); a flush
(:meth:`ShardSlot.absorb_into`) adds the delta into the aggregation's float64 totals through
``Aggregation.absorb`` (the one writer of a shard's totals is its worker) and restarts the delta. A flush is due
every ``FLUSH_STEPS`` steps (the float32 rounding error of the sums stays bounded, the int32 counters far from
overflow), and under fixed point before its int32 limbs could overflow. The worker decides when (never while the
committer writes the totals); this module says how.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from clipd.engine import FIXED_POINT_DELTA_ROWS, PartialState
from clipd.server.aggregations import Aggregation
from clipd.server.summing.batch import Batch
from clipd.server.summing.memory import aligned_empty
from clipd.server.summing.packing import Done, Step
from clipd.server.summing.programs import bucket_for, bucket_sizes, step_programs

FLUSH_STEPS = 256  # steps after which the float32 delta is added into the float64 totals


@dataclasses.dataclass
class InFlight:
    """The step on the device now, and what it completes once done."""

    aggregation: Aggregation
    shard: int
    done: list[Done]
    step: int = 0  # the worker's step count when it was dispatched
    holds: list[Batch] = dataclasses.field(default_factory=list)  # batches whose own buffers it reads
    example: list[np.ndarray] | None = None  # a measured example (sums on the host): its layers, to add
    scales: Any = None  # ... and its ExampleScales (on the device until read)
    staged: bool = False  # its layers are a staging buffer (the next fill writes over them)
    stats: Any = None  # the device statistics read when it finished (None: not read this time)

    def give_back(self) -> None:
        for batch in self.holds:
            batch.give_back()
        self.holds = []


@dataclasses.dataclass
class ShardSlot:
    """The device side of one shard of an aggregation: its delta, what the delta covers, its staging buffers,
    and its checkpoint schedule (``checkpoints.checkpoint_due_at``)."""

    delta: Any  # AccumulatorState on the device, since the last flush
    marks: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)  # client -> (seq, writer)
    batches: int = 0
    nbytes: int = 0
    steps: int = 0
    staging: list[list[np.ndarray]] | None = None
    next_staging: int = 0
    stats_read: float = 0.0
    dirty: bool = False  # batches summed since the last checkpoint started
    unsaved_bytes: int = 0  # bytes of those batches
    last_commit_seconds: float = 0.5  # how long the last checkpoint took to write (a guess before the first)
    spaced_by_duty: bool = True  # the duty cycle spaced the last checkpoint (a large one), and no crowd of calls waited
    full_since: float | None = None  # when unsaved_bytes reached half a checkpoint's (time.monotonic())
    checkpoint_due: float = 0.0  # time.monotonic() when the next checkpoint may start
    committing: bool = False
    queued: Any = None  # the totals last handed to the committer (a final commit of the same ones writes nothing);
    # CHECKPOINT_FAILED once the committer could not write them
    unadded: list[InFlight] = dataclasses.field(default_factory=list)  # measured examples waiting to be added
    # into the totals (sums on the host) while the committer writes them; they hold their batches

    def give_back(self) -> None:
        for inflight in self.unadded:
            inflight.give_back()
        self.unadded = []

    def staging_buffers(self, aggregation: Aggregation) -> list[np.ndarray]:
        """The staging buffer not used by the step in flight (two, taken in turn; made when first needed)."""
        if self.staging is None:
            self.staging = [
                [aligned_empty((aggregation.device_rows, *layer.shape), layer.dtype) for layer in aggregation.layers]
                for _ in range(2)
            ]
        buffers = self.staging[self.next_staging]
        self.next_staging = 1 - self.next_staging
        return buffers

    def run(self, aggregation: Aggregation, step: Step) -> tuple[list[np.ndarray] | None, Any]:
        """Starts one packed step on the device (asynchronously): its rows padded to their bucket size (or two
        buckets': :func:`step_programs`), into the delta. Returns the example and its scales (on the device until
        read) where the step only measures it (the sums on the host: the caller adds it,
        ``Aggregation.add_example``), else ``(None, None)``."""
        buckets = bucket_sizes(aggregation.device_rows)
        weighted = aggregation.weighted and step.weights is not None
        # Aligned numpy views go to the jitted step as they are: on the CPU JAX reads them in
        # place (one jax.device_put per array costs more than the step for small batches).
        if self.delta.sum_chunks is None:  # sums on the host: the step measures (one example: one bucket)
            bucket = bucket_for(step.rows, buckets)
            layers = [buf[:bucket] for buf in step.layers]
            self.delta, scales = aggregation.accumulator.measure(self.delta, layers, np.arange(bucket) < step.rows,
                                                                 self._weights(step, 0, bucket) if weighted else None)
            self.steps += 1
            return layers, scales
        for start, bucket in step_programs(step.rows, buckets):
            layers = [buf[start:start + bucket] for buf in step.layers]
            valid = np.arange(bucket) < step.rows - start
            fresh = aggregation.device_rows == 1 and self.steps == 0  # the delta was flushed: written over
            self.delta = aggregation.accumulator.update(self.delta, layers, valid, fresh,
                                                        self._weights(step, start, bucket) if weighted else None)
            self.steps += 1  # (each program's sums are one more float32 addition into the delta)
        return None, None

    @staticmethod
    def _weights(step: Step, start: int, bucket: int) -> np.ndarray:
        """The weights of a program's rows: each row's, the padding's 1."""
        weights = np.ones(bucket, np.float32)
        own = step.weights[start:min(start + bucket, step.rows)]  # type: ignore[index]  # (weighted: given)
        weights[:len(own)] = own
        return weights

    def count(self, done: list[Done]) -> None:
        """A step's batches are in the delta (or, for measured examples, the totals): their marks move up."""
        for client, writer, sequence, _, nbytes in done:
            self.marks[client] = (sequence, writer)
            self.batches += 1
            self.nbytes += nbytes
            self.unsaved_bytes += nbytes
        self.dirty = self.dirty or bool(done)

    def flush_due(self, aggregation: Aggregation) -> bool:
        """FLUSH_STEPS steps since the last flush, or (fixed point) one more step could overflow its int32 limbs."""
        fixed_point_full = (aggregation.accumulator.fixed_point_step
                            and (self.steps + 1) * aggregation.device_rows > FIXED_POINT_DELTA_ROWS)
        return self.steps >= FLUSH_STEPS or bool(fixed_point_full)

    def absorb_into(self, aggregation: Aggregation, shard: int, restart: bool = True) -> PartialState:
        """Adds the delta (and the marks, batches and bytes it covers) into the shard's totals and restarts it
        (``restart=False``: the slot is done with)."""
        delta = jax.device_get(self.delta)  # on the CPU, views of the device buffers
        totals = aggregation.absorb(shard, delta, self.marks, self.batches, self.nbytes)
        del delta
        # (a delta of one example a step with sums: the next, fresh, step writes over it)
        if restart and (aggregation.device_rows > 1 or self.delta.sum_chunks is None):
            self.delta = aggregation.accumulator.reset(self.delta)
        self.marks, self.batches, self.nbytes, self.steps = {}, 0, 0, 0
        return totals
