"""The control process's side of its shard hosts: one supervisor over a launcher that starts them.

A *shard host* is a process that sums shards (:class:`clipd.server.shards.host.ShardHost`), whatever launched it.
:class:`ShardHosts` is the one supervisor: it opens an aggregation in every host, finalizes it (``Finish`` in each,
a fence, the final checkpoints read back), polls their statistics and loads, and answers for them as the server's
:class:`~clipd.server.lifecycle.Shards`. What differs between hosts that are local subprocesses and hosts that are
Ray actors is a :class:`HostLauncher`: how they start, are called, are watched and stop
(:class:`~clipd.server.shards.launchers.LocalProcesses`, :class:`~clipd.server.shards.ray_hosts.RayActors`), as
dask's ``SpecCluster`` takes a ``ProcessInterface``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from typing import Protocol

from clipd.engine import PartialState
from clipd.server.aggregations import TAKES_BATCHES, Aggregation, Registry, State, Stats
from clipd.server.errors import ClipdError, DeadlineExceeded, FailedPrecondition, Unavailable, Unimplemented
from clipd.server.internal.v1 import shard_host_pb2 as host_pb
from clipd.server.lifecycle import fail
from clipd.server.progress import Progress
from clipd.server.shards.protocol import stats_from_proto
from clipd.server.stores.base import CLOSING, Store
from clipd.server.summing.devices import owner_of


class HostLauncher(Protocol):
    """How a server's shard hosts are started, reached, watched and stopped."""

    count: int  # how many hosts
    port: int  # the public port: the local processes' (held by the control until they take it), else the control's
    control_address: str | None  # where the control listens for the hosts' calls; None: its public port

    def reach_control_at(self, host: str, port: int) -> None:
        """The control's public address, once bound, for hosts that dial it (Ray's, on other nodes)."""

    def start(self) -> None:
        """Starts every host and returns once each is serving; from then on restarts one that dies."""

    def call(self, index: int, name: str, request, timeout: float):
        """One of the control's calls (``protocol.CALLS``) to host ``index``: its answer message, or its failure
        raised as a ``ClipdError`` (``protocol.host_error``)."""

    def endpoints(self) -> list[str]:
        """Where clients reach each host directly (``host:port``; "" for one not known yet)."""

    def processes(self) -> list[dict]:
        """Each host: ``index``, ``pid``, ``alive``, ``serving``, ``restarts`` (start-up retries too), ``endpoint``."""

    @property
    def ready(self) -> bool:
        """Every host serves."""

    def stop(self, timeout: float) -> None:
        """Stops every host (each commits what it summed), within about ``timeout`` seconds."""


class HostedAggregation:
    """The control process's read-only view of the numbers of an aggregation that its shard hosts sum: their last
    reports (each shard's totals without sums, the clients they have seen) and the progress counted from them.

    Written by the supervisor's poll alone (:meth:`report`); the aggregation's state, spec and release stay the
    aggregation's. Once it is finalized (or failed), the aggregation's own (final) statistics are read instead.
    """

    def __init__(self, aggregation: Aggregation) -> None:
        self.aggregation = aggregation
        self._lock = threading.Lock()
        self._shards: dict[int, PartialState] = {}
        self._clients = 0
        self._progress = Progress(aggregation.created)

    def report(self, states: dict[int, PartialState], clients: int) -> None:
        """The hosts' latest statistics of these shards, and the clients they have seen (summed over them)."""
        with self._lock:
            self._shards.update(states)
            self._clients = clients
            totals = list(self._shards.values())
            self._progress.count_to(sum(s.examples for s in totals), sum(s.batches for s in totals),
                                    sum(s.bytes for s in totals), time.time())

    def stats(self) -> Stats:
        with self._lock:
            if not self._shards or self.aggregation.state not in (*TAKES_BATCHES, State.FINALIZING):
                return self.aggregation.stats()
            totals = PartialState.merge_all(list(self._shards.values()), with_sums=False)
            counts, clients = self._progress.counts(), self._clients
        return self.aggregation.stats_over(totals, counts, clients)

    def throughput(self) -> tuple[list[tuple[int, int]], bool]:
        with self._lock:
            return self._progress.throughput()


class ShardHosts:
    """The control process's shards: N shard hosts, whatever launched them, and the calls that span them.

    It has the calls of :class:`~clipd.server.summing.devices.Devices` that the servicer uses, so the servicer is
    the same in every topology.
    """

    def __init__(self, settings, store: Store, launcher: HostLauncher) -> None:
        self.settings, self.store, self.launcher = settings, store, launcher
        self.count = launcher.count
        self._started = False
        self._stopping = threading.Event()
        self.registry: Registry | None = None
        self._seen: dict[int, host_pb.StatsResponse] = {}  # the last Stats answer of each host
        self._empty: dict[str, PartialState] = {}
        self._hosted: dict[Aggregation, HostedAggregation] = {}  # what the hosts report of each open aggregation
        self._fenced: set[str] = set()  # aggregations whose shards this control claimed at finalize
        self._pump_thread = threading.Thread(target=self._pump, name="clipd-shards-stats", daemon=True)

    def __len__(self) -> int:
        return self.count

    def start(self, registry: Registry) -> ShardHosts:
        """Starts every host (returns once each serves) and the statistics' poll."""
        self.registry = registry
        self.launcher.start()
        self._started = True
        self._pump_thread.start()
        return self

    def _call(self, index: int, name: str, request, timeout: float, quiet: bool = False):
        """A call to host ``index``: its answer; None if it failed (``quiet``), else its error raised."""
        try:
            return self.launcher.call(index, name, request, timeout)
        except ClipdError:
            if quiet:
                return None
            raise

    # The servicer's calls --------------------------------------------------------------------------------
    def warm_up(self, aggregation: Aggregation) -> None:
        """Every host opens the aggregation (compiles its programs); it is OPEN once they all have."""
        if not self._started:  # recovery, before the hosts start: they open it when first asked
            aggregation.mark_open()
            return

        def open_everywhere():
            for index in range(min(self.count, aggregation.shards)):
                self._call(index, "Open", host_pb.OpenRequest(aggregation_id=aggregation.id),
                           timeout=self.settings.warmup_timeout, quiet=True)
            aggregation.mark_open()

        threading.Thread(target=open_everywhere, name=f"clipd-open-{aggregation.id}", daemon=True).start()

    def submit(self, aggregation, client: str, writer: str, batch) -> None:
        raise Unavailable("the control process sums nothing: Submit goes to the shard hosts")

    def sum_in_line(self, aggregation, client: str, writer: str, batch) -> None:
        raise Unimplemented("Step: this server sums every batch in its Ray shard hosts and none itself: use"
                            " CreateAggregation, Submit and Finalize")

    def commit_final(self, aggregation: Aggregation, timeout: float | None = None) -> list[PartialState]:
        """Closes the aggregation in every host, fences them out and reads back every final checkpoint."""
        deadline = time.monotonic() + (timeout if timeout is not None else 3600.0)
        if aggregation.id not in self._fenced:  # a retry after the fence reads the checkpoints again
            self.store.set_state(aggregation.id, CLOSING)
            owners = sorted({owner_of(k, self.count) for k in range(aggregation.shards)})
            with concurrent.futures.ThreadPoolExecutor(len(owners), thread_name_prefix="clipd-finish") as pool:
                try:
                    for finished in [pool.submit(self._finish, i, aggregation, deadline) for i in owners]:
                        finished.result()
                except FailedPrecondition as e:  # a host failed it: so does the aggregation
                    fail(aggregation, self.store, str(e))
                    raise
            for k in range(aggregation.shards):  # from here on, no host's checkpoint can land
                self.store.claim_shard(aggregation.id, k)
            self._fenced.add(aggregation.id)
        totals = [self.store.load_checkpoint(aggregation.id, shard=k, newest_only=True)
                  for k in range(aggregation.shards)]
        read = [t for t in totals if t is not None]
        if len(read) < len(totals):
            missing = totals.index(None)
            raise FailedPrecondition(f"aggregation {aggregation.id}: the final checkpoint of shard {missing}"
                                     " can't be read back")
        return read

    def _finish(self, index: int, aggregation: Aggregation, deadline: float) -> None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"aggregation {aggregation.id}: shard host {index} did not commit its"
                                       " final checkpoints in time")
            try:
                self._call(index, "Finish", host_pb.FinishRequest(aggregation_id=aggregation.id, timeout_seconds=left),
                           timeout=left + 1.0)
                return
            except Unavailable:
                time.sleep(0.1)  # restarting: it opens the aggregation from the store again

    def forget(self, aggregation: Aggregation) -> None:
        for index in range(self.count):
            self._call(index, "Forget", host_pb.ForgetRequest(aggregation_id=aggregation.id), timeout=10.0, quiet=True)
        self._empty.pop(aggregation.id, None)
        self._fenced.discard(aggregation.id)
        if aggregation.state is State.CANCELLED:  # (a finalized one keeps its throughput series until deleted)
            self._hosted.pop(aggregation, None)

    def finished(self, aggregation: Aggregation) -> None:
        """Finalized (the store says so): the hosts drop their copies (a late Submit is refused)."""
        threading.Thread(target=self.forget, args=(aggregation,), name="clipd-forget", daemon=True).start()

    def endpoints(self) -> list[str]:
        return self.launcher.endpoints()

    # Statistics: polled from the hosts ---------------------------------------------------------------------
    def _pump(self, period: float = 0.5) -> None:
        while not self._stopping.wait(period):
            with contextlib.suppress(Exception):
                self.poll()

    def poll(self) -> None:
        """Reads every host's statistics of the open aggregations into the control's aggregations."""
        if self.registry is None:  # not started
            return
        live = [a for a in self.registry.all()  # (a buffered stream's buffers are summed by the control: routed.py)
                if a.state in (*TAKES_BATCHES, State.FINALIZING) and not a.spec.stream]
        ids = [a.id for a in live]
        answers = {}
        for index in range(self.count):
            answer = self._call(index, "Stats", host_pb.StatsRequest(aggregation_ids=ids), timeout=5.0, quiet=True)
            if answer is not None:
                answers[index] = self._seen[index] = answer
        for aggregation in live:
            empty = self._empty.get(aggregation.id)
            if empty is None:
                empty = self._empty[aggregation.id] = PartialState.empty(aggregation.layers)
            states, failed, clients = {}, "", 0
            for answer in answers.values():
                if aggregation.id in answer.aggregations:
                    found = answer.aggregations[aggregation.id]
                    states.update({k: stats_from_proto(empty, v) for k, v in found.shards.items()})
                    failed = failed or found.failure_reason
                    clients += found.clients
            if failed and aggregation.state in TAKES_BATCHES:
                fail(aggregation, self.store, failed)
            elif states and aggregation.state in (*TAKES_BATCHES, State.FINALIZING):
                self._view(aggregation).report(states, clients)

    def _view(self, aggregation: Aggregation) -> HostedAggregation:
        view = self._hosted.get(aggregation)
        if view is None:
            view = self._hosted[aggregation] = HostedAggregation(aggregation)
        return view

    def stats(self, aggregation: Aggregation) -> Stats:
        """The aggregation's statistics as its hosts last reported them (its own, once it is finished)."""
        view = self._hosted.get(aggregation)
        return aggregation.stats() if view is None else view.stats()

    def throughput(self, aggregation: Aggregation) -> tuple[list[tuple[int, int]], bool]:
        view = self._hosted.get(aggregation)
        return ([], False) if view is None else view.throughput()

    @property
    def payload_bytes(self) -> int:
        """Submit payload bytes the hosts received (as of their last statistics)."""
        return sum(a.payload_bytes for a in self._seen.values())

    def loads(self) -> dict[int, host_pb.Load]:
        """Each host's streams, buffers and refusals, as of its last statistics (absent until then)."""
        return {index: answer.load for index, answer in self._seen.items()}

    # The server ----------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._started and self.launcher.ready

    @property
    def queued_bytes(self) -> int:
        return sum(a.queued_bytes for a in self._seen.values())

    @property
    def queue_depth(self) -> int:
        return sum(a.queue_depth for a in self._seen.values())

    @property
    def device_kind(self) -> str:
        devices = self.describe()
        return devices[0]["kind"] if devices else "shard processes"

    def describe(self) -> list[dict]:
        """Every host's devices (as of its last statistics), with the host's index."""
        return [{"id": d.id, "kind": d.kind, "platform": d.platform, "steps": d.steps, "process": i}
                for i, a in sorted(self._seen.items()) for d in a.devices]

    def describe_processes(self) -> list[dict]:
        """Each host as its launcher sees it, with the payload bytes it reported."""
        return [{**process, "payload_bytes": self._seen[i].payload_bytes if i in self._seen else None}
                for i, process in enumerate(self.launcher.processes())]

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        self.launcher.stop(10.0 if timeout is None else timeout)
