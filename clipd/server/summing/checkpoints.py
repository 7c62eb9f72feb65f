"""A device worker's checkpoints: when the next one of a shard is due, and the thread that writes them.

Group commit: one checkpoint covers every batch a shard summed since the last, and a batch is acknowledged once
a committed checkpoint holds it (``Aggregation.mark_durable``). The committer writes a worker's checkpoints in
order, on a thread of its own (fsyncs stay off the step loop), and tells the worker when each is written.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from clipd.server.aggregations import Aggregation, State
from clipd.server.errors import Unavailable
from clipd.server.stores.base import Store

log = logging.getLogger(__name__)
CHECKPOINT_FAILED = object()  # a slot's ``queued`` once the committer could not write them


def checkpoint_due_at(key: tuple[Aggregation, int], slot, now: float, queued) -> float | None:
    """When the shard's next checkpoint may start (None: nothing to write, or it is being written).

    Every ``checkpoint_interval``, spaced so that writing takes at most ``checkpoint_max_duty`` of the
    time. Where that duty cycle is what spaces them (a large model, whose checkpoint takes long), at once
    when the batches waiting for it hold at least half the bytes it writes (whole updates: spacing those
    would only delay their acknowledgements, which their clients wait for) and no batch of the shard is
    queued (summed first: one checkpoint for both), or, while a stream is receiving a batch of the shard,
    once that had as long as the last checkpoint took to write (waiting less than a checkpoint takes costs
    this one less than a second checkpoint costs that one). A small model's checkpoints keep the interval
    whatever they hold, and so do a crowd's (``busy_checkpoint_interval``: see :func:`checkpoint_spacing`):
    a round of thousands of one-message clients shares one every interval, instead of one a step.
    """
    aggregation, shard = key
    if not slot.dirty or slot.committing or key in queued:
        return None
    if 2 * slot.unsaved_bytes < aggregation.parameters * 8 or not slot.spaced_by_duty:
        return slot.checkpoint_due
    if slot.full_since is None:
        slot.full_since = now
    if aggregation.arriving(shard) > 0:
        return min(slot.checkpoint_due, slot.full_since + slot.last_commit_seconds)
    return now


def checkpoint_spacing(took: float, interval: float, max_duty: float, busy: bool = False,
                       busy_interval: float = 0.0) -> float:
    """Seconds from one checkpoint's start to the next one's, after one that took ``took`` seconds to write:
    ``interval``, or more so that writing takes at most ``max_duty`` of the time; ``busy`` (a crowd of
    independent submissions waits on the checkpoints: a round's clients), at least ``busy_interval``.

    >>> checkpoint_spacing(0.001, 0.01, 0.25)                          # a small state: the interval
    0.01
    >>> checkpoint_spacing(0.5, 0.01, 0.25)                            # a large one: writing 1/4 of the time
    2.0
    >>> checkpoint_spacing(0.001, 0.01, 0.25, busy=True, busy_interval=0.05)   # a round's clients
    0.05
    """
    spacing = max(interval, took / max_duty)
    return max(spacing, busy_interval) if busy else spacing


class Committer:
    """The thread that writes one device worker's checkpoints in order, then acknowledges what they cover.

    An item is ``(aggregation, shard, totals, final, slot)``: ``final`` None for a periodic checkpoint, else a
    Future that the final commit's result (or error) is set on. A final commit whose totals are the ones last
    queued (``slot.queued``) writes nothing again; one whose checkpoint failed fails too.
    ``written(item, started, took, error)`` runs after each, on this thread.
    """

    def __init__(self, store: Store, written: Callable[[Any, float, float, Exception | None], None]) -> None:
        self.store = store
        self._written = written
        self._items: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="clipd-committer", daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        self._items.put(item)

    def stop(self, timeout: float | None) -> None:
        """Writes what is queued, then ends (waiting up to ``timeout`` seconds)."""
        self._items.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            aggregation, shard, totals, final, slot = item
            # In order: a final commit's checkpoint before it has been written (or failed) by now.
            queued = slot.queued if slot is not None and final is not None else None
            started = time.monotonic()
            error: Exception | None = None
            try:
                if queued is CHECKPOINT_FAILED:  # the checkpoint this final commit relies on
                    raise Unavailable(f"the last checkpoint of aggregation {aggregation.id} failed")
                # Else nothing summed since that checkpoint, which holds these totals.
                if queued is not totals:
                    self.store.save_checkpoint(aggregation.id, totals, shard=shard, epoch=aggregation.epoch(shard))
            except Exception as e:
                error = e
                if aggregation.state is State.CANCELLED:  # cancelled (its record gone) while this one was queued
                    log.debug("checkpoint of aggregation %s dropped: cancelled", aggregation.id)
                else:
                    log.exception("checkpoint of aggregation %s failed", aggregation.id)
            else:
                aggregation.mark_durable(totals.clients)
            if final is not None:
                if error is not None:
                    final.set_exception(error)
                else:
                    final.set_result(totals)
            self._written(item, started, time.monotonic() - started, error)
