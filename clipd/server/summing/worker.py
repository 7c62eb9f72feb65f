"""The device worker: the one thread that owns the JAX device state of the shards on one device.

A server runs one worker per local JAX device (:class:`clipd.server.summing.devices.Devices`);
each aggregation is split into shards by client id and every shard is summed
by one worker. Everything below is about one worker and its shards.

Validated batches wait in a queue; their bytes are held in the server's buffer
budget (``limits.ByteBudget``) until the worker has copied them, so a busy
device makes the streams wait (back-pressure). The worker packs consecutive batches of one
aggregation (:mod:`~clipd.server.summing.packing`) into a 64-byte-aligned host staging buffer of
``device_rows`` rows,
hands it to the jitted accumulator step padded to the next bucket size (so each
layer spec compiles a handful of programs once, at warm-up), and runs it.
Steps are asynchronous: while the device sums one buffer, the worker copies
the next batches into the aggregation's other buffer.

Durability (group commit; a shard's delta and its flush: :mod:`~clipd.server.summing.slots`).
The device holds a *delta* (float32 sums, int32 counts) since the last flush.
A flush adds the delta into the aggregation's
host totals (a ``PartialState`` in float64/int64, with each client's highest
summed sequence) and restarts the delta from zero. A checkpoint is a flush
whose totals the committer thread then writes to the store; once the commit
returns, the batches it covers are acknowledged. One checkpoint covers every
batch summed since the previous one. Checkpoints of an aggregation start at
most every ``checkpoint_interval`` seconds, and further apart when writing
takes long (large models): writing takes at most ``checkpoint_max_duty`` of
the time, unless the batches waiting hold half the bytes a checkpoint writes
(whole updates of a large model); while a crowd of one-message calls is in
flight (a round's clients), at most every ``busy_checkpoint_interval``.
A delta is also flushed every ``FLUSH_STEPS`` steps, which bounds the float32
rounding error of the sums and keeps the int32 counters far from overflow.

Large updates (one example a step): a batch whose own rows fill a step in
64-byte-aligned buffers goes to the step as it is (no staging copy). On the
CPU the step only measures the example (``ClipAccumulator.measure``: its
norms, statistics and per-layer scales) and the worker adds ``m * x`` into
the float64 totals itself (``engine.add_example``), in place, never while the
committer writes them (the example then waits, its buffer held, until the
commit is done): there is no float32 delta, and one pass over the update
less. Elsewhere (a GPU) the step adds it into the device delta, and the step
after a flush writes over the delta (``fresh``) instead of the delta being
zeroed first. So a shard holds its totals (and on a GPU its delta) and the
updates in flight, each once.

Warm-up (compiling an aggregation's programs) runs on a thread of its own, so
compiling one aggregation never stalls the others' steps; batches that arrive
for it meanwhile are parked and run once it is open. A warm-up that takes
longer than ``warmup_timeout`` seconds fails its aggregation.

A step that fails (or a warm-up, or a checkpoint write) fails its aggregation:
state FAILED with the reason; its queued batches are dropped and its streams
and Finalize get the error.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from clipd.engine import PartialState
from clipd.server.aggregations import Aggregation, State
from clipd.server.errors import Unavailable
from clipd.server.lifecycle import fail
from clipd.server.stores.base import Store
from clipd.server.summing.batch import Batch
from clipd.server.summing.checkpoints import CHECKPOINT_FAILED, Committer, checkpoint_due_at, checkpoint_spacing
from clipd.server.summing.packing import Step, pack
from clipd.server.summing.programs import already_compiled, compile_programs, sums_on_host
from clipd.server.summing.slots import InFlight, ShardSlot

log = logging.getLogger(__name__)
STATS_PERIOD = 0.1  # seconds between reads of the device statistics while batches keep coming
FILL_WAIT = 0.002  # how long a step less than half full waits for more batches (seconds)
LARGE_PARAMETERS = 1 << 22  # an aggregation this large warms up on a thread even when compiled (its totals)


@dataclasses.dataclass
class _Work:
    aggregation: Aggregation
    shard: int
    client: str
    writer: str
    batch: Batch


@dataclasses.dataclass
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


class _Stop:
    pass


class DeviceWorker:
    """Runs every device step of one device, in one thread; a second thread commits checkpoints."""

    def __init__(self, store: Store, checkpoint_interval: float = 0.05, checkpoint_max_duty: float = 0.25,
                 warmup_timeout: float = 300.0, device: jax.Device | None = None,
                 busy_checkpoint_interval: float = 0.05) -> None:
        self.store = store
        self.warmup_timeout = warmup_timeout
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_max_duty = checkpoint_max_duty
        self.busy_checkpoint_interval = busy_checkpoint_interval
        # Whether a crowd of independent submissions waits on this process's checkpoints (Admission.crowded: two
        # or more one-message calls in flight); while one does, checkpoints are spaced by busy_checkpoint_interval.
        self.crowded: Callable[[], bool] = lambda: False
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._stopping = False
        self._recheck = False  # set by the committer: a checkpoint may have become due
        # Keyed by (aggregation object, shard): a re-created id is another key.
        self._slots: dict[tuple[Aggregation, int], ShardSlot] = {}
        self._shards: dict[Aggregation, tuple[int, ...]] = {}  # the shards of each aggregation this worker sums
        self._warming: set[Aggregation] = set()  # compiling; their batches are parked meanwhile
        self._parked: dict[Aggregation, list[_Work]] = {}
        self._inflight: InFlight | None = None
        self.device = device if device is not None else jax.devices()[0]  # every step of this worker runs here
        self.device_kind = self.device.device_kind
        self.steps = 0  # clip-and-sum steps dispatched, over every aggregation
        self.ready = threading.Event()  # set once the device has run a first program
        self.on_failed: Callable[[Aggregation], Any] | None = None  # told when this worker fails an aggregation
        self.records_failures = True  # False in a shard process: the control process owns the state in the store
        self._thread = threading.Thread(target=self._run, name=f"clipd-device-worker-{self.device.id}", daemon=True)
        self._committer = Committer(store, self._written)
        self._thread.start()

    # Producer side (gRPC handler threads) -----------------------------------------
    def submit(self, aggregation: Aggregation, shard: int, client: str, writer: str, batch: Batch) -> None:
        """Queues an accepted batch of one of this worker's shards (its bytes are reserved in the buffer budget)."""
        with self._cond:
            if self._stopping:
                raise Unavailable("the server is shutting down")
            self._queue.append(_Work(aggregation, shard, client, writer, batch))
            self._queued_bytes += batch.nbytes
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Runs ``fn`` on the worker thread, after everything queued before it, and returns its result."""
        return self._enqueue_call(fn).result(timeout)

    def _enqueue_call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._queue.append(_Call(fn, future))
            self._cond.notify_all()
        return future

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def warm_up(self, aggregation: Aggregation, shards: tuple[int, ...] = (0,),
                then: Callable[[Aggregation], Any] | None = None) -> None:
        """Compiles every bucket size of ``aggregation`` for this device on a thread of its own, for ``shards``.

        The shards get their device state, and the aggregation opens, when done. ``then`` (a large model's:
        its receive buffers prepared, ``ByteBudget.prepare``) runs first on the warm-up thread.

        Batches that come before are parked by the worker and run after. If the
        compilation is not done within ``warmup_timeout`` the aggregation fails
        (the compilation itself can't be interrupted: its result is dropped).
        """
        with self._cond:
            self._warming.add(aggregation)
            self._shards[aggregation] = tuple(shards)
        compiled = already_compiled(aggregation, self.device)
        if compiled and aggregation.parameters < LARGE_PARAMETERS and then is None:  # compiled by an earlier one
            self.call_soon(lambda: self._open(aggregation))
            return
        threading.Thread(target=self._compile, args=(aggregation, then), name=f"clipd-warmup-{aggregation.id}",
                         daemon=True).start()
        timer = threading.Timer(self.warmup_timeout, self._warm_up_overdue, args=(aggregation,))
        timer.name = f"clipd-warmup-timer-{aggregation.id}"
        timer.daemon = True
        timer.start()

    def _warm_up_overdue(self, aggregation: Aggregation) -> None:
        reason = f"warm-up (compilation) took longer than {self.warmup_timeout:g} s"

        def fail_if_still_warming():  # on the worker thread: it may have opened meanwhile
            if aggregation in self._warming:
                self._fail(aggregation, reason)

        self.call_soon(fail_if_still_warming)

    def commit_final(self, aggregation: Aggregation, shard: int,
                     timeout: float | None = None) -> concurrent.futures.Future:
        """Flushes the shard's delta, commits its totals as its final checkpoint, frees its device state.

        Returns a future of the committed totals. Runs after everything queued
        before it; the final commit goes through the committer after any
        checkpoint of the same shard still being written, so an older
        checkpoint can never land after it. The aggregation stays open in the
        store: the caller marks it FINALIZED (or releases it) once every shard is in.
        """
        finished: concurrent.futures.Future = concurrent.futures.Future()

        def flush_and_commit():
            slot = self._slots.get((aggregation, shard))
            totals = self._flush(aggregation, shard)
            self._slots.pop((aggregation, shard), None)
            self._committer.put((aggregation, shard, totals, finished, slot))  # the committer decides: write or not

        def failed(call: concurrent.futures.Future) -> None:
            if (error := call.exception()) is not None:
                finished.set_exception(error)

        self._enqueue_call(flush_and_commit).add_done_callback(failed)
        return finished

    def forget(self, aggregation: Aggregation) -> None:
        """Frees an aggregation's device state, staging buffers and parked batches."""

        def drop():
            self._drop_slots(aggregation)
            self._drop_parked(aggregation)
            self._shards.pop(aggregation, None)

        self.call(drop)

    def _streams_ended(self) -> None:
        """An aggregation's last open stream ended: a step waiting to be filled with its batches runs now."""
        with self._cond:
            self._cond.notify_all()

    def _drop_slots(self, aggregation: Aggregation) -> None:
        for shard in self._shards.get(aggregation, ()):
            slot = self._slots.pop((aggregation, shard), None)
            if slot is not None:
                slot.give_back()

    def _drop_parked(self, aggregation: Aggregation) -> None:
        with self._cond:
            self._warming.discard(aggregation)
        parked = self._parked.pop(aggregation, [])
        for work in parked:
            work.batch.give_back()
        if parked:
            aggregation.drop(len(parked))

    def stop(self, timeout: float | None = None) -> None:
        """Finishes everything queued, commits a last checkpoint of every aggregation, stops both threads."""
        with self._cond:
            self._queue.append(_Stop())
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._committer.stop(timeout)

    # The worker thread ----------------------------------------------------------------
    def _take(self, timeout: float | None):
        """The next queued item, or None after ``timeout`` seconds (None: wait for one)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._queue) or self._recheck, timeout)
            self._recheck = False
            if not self._queue:
                return None
            item = self._queue.popleft()
            if isinstance(item, _Work):
                self._queued_bytes -= item.batch.nbytes
                self._cond.notify_all()
            return item

    def _more_for(self, aggregation: Aggregation, shard: int, rows: int, deadline: float = 0.0) -> _Work | None:
        """The next queued batch if it belongs to the shard and fits in ``rows`` more rows.

        With an empty queue it waits until ``deadline`` (``time.monotonic()``) for one to arrive, while a
        stream of the aggregation is still open: once every stream has ended (a trainer's one batch per
        step, a client's last), nothing more can come, and the step runs at once.
        """
        with self._cond:
            while not self._queue and aggregation.receiving and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)  # a new batch, or the last stream's end (_streams_ended), notifies it
            if self._queue:
                head = self._queue[0]
                if (isinstance(head, _Work) and head.aggregation is aggregation and head.shard == shard
                        and head.batch.rows <= rows):
                    self._queue.popleft()
                    self._queued_bytes -= head.batch.nbytes
                    self._cond.notify_all()
                    return head
        return None

    def _wait_budget(self) -> float | None:
        """How long the worker may wait for new work: 0 with a step in flight, else until a checkpoint is due."""
        if self._inflight is not None:
            return 0.0
        now = time.monotonic()
        with self._cond:
            queued = {(w.aggregation, w.shard) for w in self._queue if isinstance(w, _Work)}
            due = [at for key, s in self._slots.items() if (at := checkpoint_due_at(key, s, now, queued)) is not None]
        return max(0.0, min(due) - now) if due else None

    def _run(self) -> None:
        with jax.default_device(self.device):  # thread-local: this thread's steps run on its device
            self._loop()

    def _loop(self) -> None:
        jax.block_until_ready(jax.jit(lambda x: x + 1)(np.zeros(8, np.float32)))
        self.ready.set()
        while True:
            item = self._take(self._wait_budget())
            current = item.aggregation if isinstance(item, _Work) else None
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
                    for (aggregation, shard), slot in list(self._slots.items()):  # stopping: a last checkpoint
                        if (slot.dirty or slot.steps or slot.unadded) and (aggregation, shard) in self._slots:
                            self._checkpoint(aggregation, shard)
                    return
                self._checkpoint_due()
            except Exception as e:  # a failed step: fail its aggregation, never the server
                if current is None:
                    log.exception("device worker failed outside a step")
                    continue
                self._fail(current, f"device step failed: {type(e).__name__}: {e}")

    @staticmethod
    def _run_call(item: _Call) -> None:
        try:
            item.future.set_result(item.fn())
        except Exception as e:  # handed to the caller
            item.future.set_exception(e)

    def _fail(self, aggregation: Aggregation, reason: str) -> None:
        """Fails an aggregation: its device state and queued batches are dropped, the store says FAILED."""
        failed_here = fail(aggregation, self.store if self.records_failures else None, reason)
        self.drop_failed(aggregation)
        if failed_here and self.on_failed is not None:
            self.on_failed(aggregation)  # the workers of its other shards drop theirs

    def drop_failed(self, aggregation: Aggregation) -> None:
        """On the worker thread: drops a failed aggregation's device state, parked and queued batches here."""
        self._drop_slots(aggregation)
        if self._inflight is not None and self._inflight.aggregation is aggregation:
            self._inflight.give_back()
            self._inflight = None
        self._drop_parked(aggregation)
        with self._cond:
            mine = [w for w in self._queue if isinstance(w, _Work) and w.aggregation is aggregation]
            for work in mine:
                self._queue.remove(work)
                self._queued_bytes -= work.batch.nbytes
                work.batch.give_back()
            self._cond.notify_all()
        aggregation.drop()  # every accepted batch of it that was here is gone

    def _accumulate(self, first: _Work) -> None:
        """Sums ``first`` and the batches of its shard queued behind it, in steps (:func:`packing.pack`)."""
        aggregation, shard = first.aggregation, first.shard
        slot = self._slots.get((aggregation, shard))
        if slot is None and aggregation in self._warming:
            self._parked.setdefault(aggregation, []).append(first)  # runs once the warm-up is done
            return
        if slot is None or aggregation.state in (State.CANCELLED, State.FAILED):
            first.batch.give_back()
            aggregation.drop(1)
            return
        in_place_step = None  # the last step that read a batch's own buffers
        for item in pack(first, aggregation.device_rows, functools.partial(slot.staging_buffers, aggregation),
                         functools.partial(self._more_for, aggregation, shard),
                         deadline=time.monotonic() + FILL_WAIT):  # small batches arriving one by one fill a step
            if isinstance(item, Step):
                self._dispatch(aggregation, shard, slot, item)
                in_place_step = None if item.staged else self.steps
            elif item.in_place and self._inflight is not None and self._inflight.step == in_place_step:
                self._inflight.holds.append(item.batch)  # the step in flight reads its buffers: given back after it
            else:
                item.batch.give_back()  # copied (or summed): its buffers may go

    def _dispatch(self, aggregation: Aggregation, shard: int, slot: ShardSlot, step: Step) -> None:
        self._finish_inflight()
        inflight = InFlight(aggregation, shard, step.done, self.steps + 1, staged=step.staged)
        inflight.example, inflight.scales = slot.run(aggregation, step)  # (sums on the host: _add_measured adds)
        self.steps += 1
        self._inflight = inflight

    def _finish_inflight(self) -> None:
        """Waits for the step in flight and publishes its batches and statistics."""
        if self._inflight is None:
            return
        inflight, self._inflight = self._inflight, None
        aggregation, shard = inflight.aggregation, inflight.shard
        slot = self._slots[(aggregation, shard)]
        try:
            now = time.monotonic()
            if now - slot.stats_read >= STATS_PERIOD or not self._queue:
                inflight.stats = jax.device_get(slot.delta.statistics_only())  # waits for the step
                slot.stats_read = now
            else:
                jax.block_until_ready(slot.delta.stats)
            if inflight.holds:  # the whole step, not only its statistics: it read these batches' own buffers
                jax.block_until_ready(slot.delta)
            if inflight.example is not None:
                inflight.scales = jax.device_get(inflight.scales)
        except Exception as e:
            inflight.give_back()
            self._fail(aggregation, f"device step failed: {type(e).__name__}: {e}")
            return
        if inflight.example is not None:  # sums on the host: added now, or once the committer is done
            slot.unadded.append(inflight)
            self._add_measured(aggregation, shard, slot, wait=inflight.staged)
            return
        inflight.give_back()  # the step has read them: their buffers may be reused
        self._summed(aggregation, shard, slot, inflight)

    def _add_measured(self, aggregation: Aggregation, shard: int, slot: ShardSlot, wait: bool = False) -> None:
        """Adds the shard's measured examples into its host totals (in place, in order), then marks them summed
        and frees their buffers. Never while the committer writes those totals: then, unless ``wait``, they
        stay for later (:meth:`_checkpoint_due`, after the commit; their batches' memory stays held)."""
        with self._cond:
            if slot.committing and not wait:
                return
            self._cond.wait_for(lambda: not slot.committing)
        while slot.unadded and self._slots.get((aggregation, shard)) is slot:
            inflight = slot.unadded.pop(0)
            try:
                assert inflight.example is not None  # (a measured example)
                aggregation.add_example(shard, inflight.example, inflight.scales)
            except Exception as e:
                inflight.give_back()
                self._fail(aggregation, f"adding an example failed: {type(e).__name__}: {e}")
                return
            inflight.give_back()
            self._summed(aggregation, shard, slot, inflight)

    def _summed(self, aggregation: Aggregation, shard: int, slot: ShardSlot, inflight: InFlight) -> None:
        """A step's batches are in the shard's sums: their marks move up, the aggregation counts them."""
        slot.count(inflight.done)
        aggregation.record(inflight.done, inflight.stats, shard)
        if slot.flush_due(aggregation):
            self._flush(aggregation, shard)

    # Flushes and checkpoints ------------------------------------------------------------
    def _flush(self, aggregation: Aggregation, shard: int) -> PartialState:
        """Adds the shard's device delta into its host totals (float64, int64) and restarts it from zero."""
        self._finish_inflight()
        slot = self._slots.get((aggregation, shard))
        if slot is None or not slot.steps:
            return aggregation.shard_state(shard)
        with self._cond:  # the totals are added to in place: never while the committer writes them
            self._cond.wait_for(lambda: not slot.committing)
        self._add_measured(aggregation, shard, slot)
        if self._slots.get((aggregation, shard)) is not slot:
            return aggregation.shard_state(shard)  # it failed meanwhile
        return slot.absorb_into(aggregation, shard)

    def _checkpoint(self, aggregation: Aggregation, shard: int) -> None:
        """Flushes and hands the shard's totals to the committer (group commit)."""
        slot = self._slots.get((aggregation, shard))
        totals = self._flush(aggregation, shard)
        if slot is None or (aggregation, shard) not in self._slots:
            return  # the aggregation failed (or was dropped) meanwhile: nothing to commit
        with self._cond:
            slot.committing, slot.dirty, slot.queued, slot.unsaved_bytes = True, False, totals, 0
            slot.full_since = None
        self._committer.put((aggregation, shard, totals, None, slot))

    def _checkpoint_due(self) -> None:
        """Adds the measured examples the committer held back, then starts the checkpoints that are due
        (:func:`~clipd.server.summing.checkpoints.checkpoint_due_at`)."""
        for (aggregation, shard), slot in list(self._slots.items()):
            if slot.unadded and not slot.committing:
                self._add_measured(aggregation, shard, slot)
        now = time.monotonic()
        with self._cond:
            queued = {(w.aggregation, w.shard) for w in self._queue if isinstance(w, _Work)}
            due = [key for key, s in self._slots.items() if (at := checkpoint_due_at(key, s, now, queued)) is not None
                   and now >= at]
        for aggregation, shard in due:
            self._checkpoint(aggregation, shard)

    def _written(self, item, started: float, took: float, error: Exception | None) -> None:
        """The committer wrote one checkpoint (or could not: ``error``): the shard's next one may be scheduled,
        and a failed one fails its aggregation (on the worker thread)."""
        aggregation, shard, totals, final, slot = item
        if error is not None:
            if final is None and slot.queued is totals:
                with self._cond:
                    slot.queued = CHECKPOINT_FAILED
            reason = f"checkpoint failed: {type(error).__name__}: {error}"
            # (bound now: the committer's next item must not change whom this fails)
            self.call_soon(functools.partial(self._fail, aggregation, reason))
        log.debug("checkpoint of aggregation %s shard %d: %d batches in %.3f s", aggregation.id, shard,
                  totals.batches, took)
        with self._cond:
            slot = self._slots.get((aggregation, shard))
            if slot is not None and final is None:
                slot.committing = False
                crowded = self.crowded()
                slot.checkpoint_due = started + checkpoint_spacing(took, self.checkpoint_interval,
                                                                   self.checkpoint_max_duty, crowded,
                                                                   self.busy_checkpoint_interval)
                # (a crowd's checkpoints keep their spacing: its acknowledgements share them however much waits)
                slot.spaced_by_duty = took / self.checkpoint_max_duty > self.checkpoint_interval and not crowded
                slot.last_commit_seconds = took
            self._recheck = True
            self._cond.notify_all()

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Runs ``fn`` on the worker thread later, without waiting for it."""
        self._enqueue_call(fn)

    def _compile(self, aggregation: Aggregation, then: Callable[[Aggregation], Any] | None = None) -> None:
        """The warm-up thread: while a thread of its own writes the zeros of new totals (``Aggregation.prefault``:
        for a large model, gigabytes of first touches), runs ``then`` (a large model's receive buffers prepared,
        as many first touches: its first updates stream in as soon as they are), then compiles (from shapes:
        nothing is run) every step program not compiled yet; then the aggregation opens. The two kinds of first
        touch side by side: on a VM that hands freed memory back to its host, each fault waits on the host,
        and two threads faulting open a 2^28 model in about two thirds of the time one takes."""
        try:
            failed: list[BaseException] = []

            def prefault_totals() -> None:
                try:
                    for shard in self._shards.get(aggregation, ()):
                        aggregation.prefault(shard)
                except BaseException as e:  # raised again on the warm-up thread, below
                    failed.append(e)

            prefault = threading.Thread(target=prefault_totals, name=f"clipd-prefault-{aggregation.id}", daemon=True)
            prefault.start()
            if then is not None:
                then(aggregation)
            compiled = compile_programs(aggregation, self.device, lambda: aggregation in self._warming)
            prefault.join()
            if failed:
                raise failed[0]
            if not compiled:
                return
        except Exception as e:
            reason = f"warm-up failed: {type(e).__name__}: {e}"
            self.call_soon(lambda: self._fail(aggregation, reason))
            return
        self.call_soon(lambda: self._open(aggregation))

    def _open(self, aggregation: Aggregation) -> None:
        """On the worker thread: the aggregation's shards get their device state; parked batches queue again."""
        if aggregation not in self._warming:
            return  # failed or cancelled meanwhile
        if aggregation.state in (State.CANCELLED, State.FAILED, State.FINALIZED):
            self._drop_parked(aggregation)
            return
        aggregation.notify_on_last_stream(self._streams_ended)
        on_host = sums_on_host(aggregation, self.device)
        for shard in self._shards[aggregation]:
            self._slots[(aggregation, shard)] = ShardSlot(aggregation.accumulator.init(sums=not on_host))
        parked = self._parked.pop(aggregation, [])
        with self._cond:
            self._warming.discard(aggregation)
            self._queue.extendleft(reversed(parked))
            self._queued_bytes += sum(w.batch.nbytes for w in parked)
            self._cond.notify_all()
        aggregation.mark_open()

