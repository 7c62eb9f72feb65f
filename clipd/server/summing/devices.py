"""Every local device at work: one device worker per JAX device, each aggregation's shards spread over them.

An aggregation of ``S`` shards on a host with ``D`` devices: shard ``s`` is
summed by the worker of device ``s % D``. A client's batches always go to the
shard :func:`~clipd.wire.shard_of` names, so a client's sequence
numbers, and its exactly-once marks, live in one shard's partial state. At
finalize every shard commits its final checkpoint (in parallel, each on its
own device) and the partial states are merged on the host.

Why a shard per device and not one step sharded over every device with an
on-device reduce: shards need no collective (devices never wait for each
other, and a small batch runs on one device instead of being split D ways);
every shard is checkpointed and recovered on its own; and the same shard is
the unit that spreads over processes and hosts. A sharded step would add a
second way to split the work for one host only.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from collections.abc import Callable
from typing import Any

import jax

from clipd.engine import PartialState
from clipd.server.aggregations import Aggregation, Stats
from clipd.server.errors import DeadlineExceeded, Unavailable
from clipd.server.stores.base import Store
from clipd.server.summing import inline
from clipd.server.summing.batch import Batch
from clipd.server.summing.worker import DeviceWorker


def owner_of(shard: int, processes: int) -> int:
    """The shard process (of ``processes``) that sums ``shard``: shards are dealt round the processes."""
    return shard % processes


class Devices:
    """The device workers of one server: where each shard runs, and the calls that span every shard.

    ``process=(i, n)``: this is shard process ``i`` of ``n`` (``clipd serve --processes n``); it sums
    the shards ``s`` with ``s % n == i``, shard ``s`` on its device ``(s // n) % D``.
    """

    def __init__(self, store: Store, checkpoint_interval: float = 0.05, checkpoint_max_duty: float = 0.25,
                 warmup_timeout: float = 300.0, devices: list | None = None,
                 process: tuple[int, int] = (0, 1), busy_checkpoint_interval: float = 0.05) -> None:
        devices = list(jax.local_devices() if devices is None else devices)
        if not devices:
            raise ValueError("Devices: no JAX device")
        self.index, self.processes = process
        self.workers = [DeviceWorker(store, checkpoint_interval, checkpoint_max_duty, warmup_timeout, device=d,
                                     busy_checkpoint_interval=busy_checkpoint_interval) for d in devices]
        # Run while an aggregation with updates of more than prepare_above bytes warms up, once in this process
        # (the servicer's: the receive buffers of its first updates faulted in).
        self.prepare_receive: Callable[[Aggregation], Any] | None = None
        self.prepare_above = 0
        for worker in self.workers:
            worker.on_failed = self._failed
            # A shard process leaves the aggregation's state in the store to the control process.
            worker.records_failures = self.processes == 1

    def _failed(self, aggregation: Aggregation) -> None:
        """A worker failed an aggregation: every worker drops its shards of it (on its own thread)."""
        for worker in self.workers:
            worker.call_soon(functools.partial(worker.drop_failed, aggregation))

    def __len__(self) -> int:
        return len(self.workers)

    def owns(self, shard: int) -> bool:
        return owner_of(shard, self.processes) == self.index

    def owned(self, shards: int) -> tuple[int, ...]:
        """The shards of an aggregation of ``shards`` shards that this process sums."""
        return tuple(range(self.index, shards, self.processes))

    def worker_of(self, shard: int) -> DeviceWorker:
        return self.workers[(shard // self.processes) % len(self.workers)]

    def shards_on(self, worker_index: int, shards: int) -> tuple[int, ...]:
        """The shards of an aggregation of ``shards`` shards that the ``worker_index``-th worker sums."""
        return tuple(s for s in self.owned(shards) if self.worker_of(s) is self.workers[worker_index])

    def endpoints(self) -> list[str]:
        """Every shard is summed here: clients need no other address."""
        return []

    # Per batch ------------------------------------------------------------------------------
    def submit(self, aggregation: Aggregation, client: str, writer: str, batch: Batch) -> None:
        """Queues an accepted batch on the worker of its client's shard."""
        shard = aggregation.shard_of(client)
        if not self.owns(shard):  # the Submit handler routes by shard: a bug, never a client's doing
            raise Unavailable(f"shard {shard} of aggregation {aggregation.id} is not summed by this process")
        self.worker_of(shard).submit(aggregation, shard, client, writer, batch)

    def sum_in_line(self, aggregation: Aggregation, client: str, writer: str, batch: Batch) -> None:
        """Sums an accepted whole batch now, on the caller's thread, on the device of its client's shard (a
        DP-SGD step's: :mod:`~clipd.server.summing.inline`)."""
        shard = aggregation.shard_of(client)
        inline.sum_batch(aggregation, shard, client, writer, batch, self.worker_of(shard).device)

    # Per aggregation ------------------------------------------------------------------------
    def warm_up(self, aggregation: Aggregation) -> None:
        """Every worker that sums a shard of the aggregation compiles its programs for its device (the first
        also runs ``prepare_receive``)."""
        then = self.prepare_receive if aggregation.example_bytes > self.prepare_above else None
        for index, worker in enumerate(self.workers):
            shards = self.shards_on(index, aggregation.shards)
            if shards:
                worker.warm_up(aggregation, shards, then)
                then = None

    def commit_final(self, aggregation: Aggregation, timeout: float | None = None) -> list[PartialState]:
        """Every shard's final checkpoint, committed (in parallel over the workers); their totals, by shard.

        In a shard process: the shards it owns, in order.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        futures = [self.worker_of(s).commit_final(aggregation, s) for s in self.owned(aggregation.shards)]
        try:
            return [f.result(None if deadline is None else max(0.0, deadline - time.monotonic())) for f in futures]
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded(f"aggregation {aggregation.id}: the final checkpoints took over {timeout:g} s"
                                   ) from None

    def forget(self, aggregation: Aggregation) -> None:
        for worker in self.workers:
            worker.forget(aggregation)

    def finished(self, aggregation: Aggregation) -> None:
        """Nothing to drop: a worker lets go of an aggregation's device state at its final checkpoint."""

    @staticmethod
    def stats(aggregation: Aggregation) -> Stats:
        return aggregation.stats()  # summed here: its own numbers

    @staticmethod
    def throughput(aggregation: Aggregation) -> tuple[list[tuple[int, int]], bool]:
        return aggregation.throughput()

    # The server -------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Every device has run a first program."""
        return all(w.ready.is_set() for w in self.workers)

    def wait_ready(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(w.ready.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                   for w in self.workers)

    @property
    def queued_bytes(self) -> int:
        return sum(w.queued_bytes for w in self.workers)

    @property
    def queue_depth(self) -> int:
        return sum(w.queue_depth for w in self.workers)

    @property
    def device_kind(self) -> str:
        return self.workers[0].device_kind

    def describe(self) -> list[dict]:
        """Each device in use and the steps it has run: ``[{"id", "kind", "platform", "steps"}, ...]``."""
        return [{"id": w.device.id, "kind": w.device_kind, "platform": w.device.platform, "steps": w.steps}
                for w in self.workers]

    def stop(self, timeout: float | None = None) -> None:
        """Stops every worker (each finishes its queue and commits a last checkpoint of its shards)."""
        with concurrent.futures.ThreadPoolExecutor(len(self.workers), thread_name_prefix="clipd-workers-stop") as pool:
            list(pool.map(lambda w: w.stop(timeout), self.workers))
