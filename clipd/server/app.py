"""Building and running the server: gRPC (with health and reflection), the worker, the admin API."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from clipd import _process
from clipd.server.admin.facade import ServerSnapshot
from clipd.server.aggregations import TAKES_BATCHES, Aggregation, AggregationSpec, Registry, Stats
from clipd.server.internal.v1 import shard_host_pb2 as host_pb
from clipd.server.lifecycle import Shards, claims_shards, fail
from clipd.server.logs import event
from clipd.server.privacy import Ledgers, Release, warm_up_in_background
from clipd.server.rpc.server import (
    clipd_handlers,
)
from clipd.server.rpc.serving import listen, serving_process
from clipd.server.settings import Settings
from clipd.server.shards.forward import reserve_port
from clipd.server.shards.protocol import describe_load, sum_loads
from clipd.server.stores import open_store
from clipd.server.stores.base import CLOSING, FAILED, FINALIZED, Store
from clipd.server.streams import Streams
from clipd.server.summing.devices import Devices
from clipd.server.summing.memory import HeapTrimmer

if TYPE_CHECKING:  # imported where they are used: FastAPI, the shard processes (and Ray) load only when asked for
    from clipd.server.admin.app import AdminServer
    from clipd.server.shards.hosts import HostLauncher, ShardHosts

log = logging.getLogger(__name__)
class ClipdServer:
    """The running service: gRPC server, device workers, registry, and (optionally) the admin API.

    With ``settings.processes`` = N > 0, this is the control process: it serves gRPC on a private
    unix socket only, and N shard processes (:mod:`clipd.server.shards.host`) listen on the gRPC
    port (and each on its own), receive, clip and sum, and forward every other call to it.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = time.time()
        self.store = open_store(settings.data_dir)
        self.registry = Registry(settings.max_aggregations, settings.max_total_parameters or None, settings.memory)
        # The topology, read here once: this process's own devices sum, or shard hosts that a launcher starts
        # (local subprocesses, Ray actors) do, under one supervisor (ShardHosts); self.hosts is None without them.
        self.hosts: ShardHosts | None = None
        self.launcher = self._launcher(settings) if settings.processes or settings.ray_address else None

        # The devices of this process, where buffered streams' buffers are summed (None: no streams, on Ray).
        self.stream_devices: Devices | None = None

        def make_shards() -> Shards:
            if self.launcher is None or settings.processes:
                self.stream_devices = Devices(self.store, settings.checkpoint_interval, settings.checkpoint_max_duty,
                                              settings.warmup_timeout,
                                              busy_checkpoint_interval=settings.busy_checkpoint_interval)
            if self.launcher is None:  # every shard on a local device
                assert self.stream_devices is not None
                return self.stream_devices
            from clipd.server.shards.hosts import ShardHosts

            self.hosts = ShardHosts(settings, self.store, self.launcher)
            if self.stream_devices is None:
                return self.hosts
            from clipd.server.shards.routed import StreamsHere

            return StreamsHere(self.hosts, self.stream_devices)  # (with --processes: streams' buffers here)

        serving = serving_process(settings, self.store, self.registry, make_shards,
                                  admin_token=settings.admin_token, handlers=clipd_handlers, role="control")
        self.devices: Shards = serving.shards
        self.ledgers, self.lifecycle = serving.ledgers, serving.lifecycle
        self.serving_process = serving
        self.servicer, self.guard, self.grpc = serving.servicer, serving.guard, serving.grpc
        self.health = serving.health
        recover(self.store, self.registry, self.devices, settings, self.ledgers)
        self.streams: Streams | None = None
        if self.stream_devices is not None:  # this process receives the updates its devices sum (all, or a stream's)
            self.servicer.attach_devices(self.stream_devices)
            self.streams = self.servicer.streams = Streams(self.lifecycle)  # (their buffers are recovered above)
            self.streams.recover()
        launcher = self.launcher
        if launcher is not None and launcher.control_address is not None:  # the hosts take the public port (and
            self.grpc.add_insecure_port(launcher.control_address)  # terminate TLS): the control listens for them
            self.port = launcher.port
        else:
            self.port = listen(self.grpc, settings, settings.grpc_port)  # TLS, or mutual TLS with a client CA
        self.admin: AdminServer | None = None
        self.stopped = threading.Event()
        self._janitor = threading.Thread(target=self._expire_results, name="clipd-janitor", daemon=True)
        self._trimmer = HeapTrimmer(self.servicer.budget)

    def _expire_results(self) -> None:
        """Deletes finalized and failed aggregations once they are older than the retention period."""
        period = min(60.0, self.settings.retention_seconds / 4)
        while not self.stopped.wait(period):
            for aggregation in self.registry.expired(time.time() - self.settings.retention_seconds):
                if aggregation.spec.stream:  # a stream's buffer: the stream keeps its last keep_versions
                    continue
                try:
                    self.lifecycle.cancel(aggregation.id)
                    event(log, "aggregation.expired", aggregation=aggregation.id,
                          retention_seconds=self.settings.retention_seconds)
                except Exception:  # already gone, or the store failed: try again next round
                    log.exception("could not expire aggregation %s", aggregation.id)

    def start(self) -> ClipdServer:
        self.grpc.start()
        if self.hosts is not None and self.launcher is not None:
            self.launcher.reach_control_at(self.settings.host, self.port)  # (hosts that dial it: for all but Submit)
            # The processes that forward calls here (the only ones counted so); returns once each is ready.
            self.guard.ingest_indexes = frozenset(str(i) for i in range(self.hosts.count))
            self.hosts.start(self.registry)
        self._janitor.start()
        self._trimmer.start()
        # (Not on a restart with aggregations to finish: their clients' streams come first; a release loads what
        # it needs itself.)
        if self.settings.warm_privacy and not any(a.state in TAKES_BATCHES for a in self.registry.all()):
            warm_up_in_background()
        self.serving_process.set_serving(True)
        log.info("clipd gRPC on %s:%d (%d x %s)", self.settings.host, self.port, len(self.devices),
                 self.devices.device_kind)
        if self.settings.admin_port >= 0:
            from clipd.server.admin.app import start_admin

            self.admin = start_admin(self, self.settings)
            log.info("clipd admin API on %s://%s:%d", self.admin.scheme, self.settings.host, self.admin.port)
        return self

    def snapshot(self) -> ServerSnapshot:
        """What the admin API shows of this server now."""
        servicer = self.servicer
        own = servicer.load(self.ledgers.participation_refusals)
        processes: list[dict] = []
        loads = [own]
        if self.hosts is not None:  # they take the Submit streams: their slots and buffers, not this process's
            own.stream_limit = own.buffer_limit = own.one_message_limit = 0
            seen = self.hosts.loads()
            processes = self.hosts.describe_processes()
            for process in processes:
                load = seen.get(process["index"])
                process["calls"] = self.guard.forwarded.get(str(process["index"]), 0)
                process.update(describe_load(load))
                loads.append(load or host_pb.Load())
        return ServerSnapshot(
            serving=self.serving, started_unix_seconds=self.started, load=sum_loads(loads),
            queue_depth=self.devices.queue_depth, queued_bytes=self.devices.queued_bytes,
            device_kind=self.devices.device_kind, devices=self.devices.describe(), shard_processes=processes,
            payload_bytes_received=servicer.payload_bytes,
            shard_payload_bytes=self.hosts.payload_bytes if self.hosts is not None else None,
            process_tuning=dict(_process.TUNED))

    # What the admin API reads and does (admin.facade.ServerFacade) ----------------------------------------------
    def aggregations(self) -> list[Aggregation]:
        return self.registry.all()

    def aggregation(self, aggregation_id: str) -> Aggregation:
        return self.registry.get(aggregation_id)

    def stats(self, aggregation: Aggregation) -> Stats:
        return self.devices.stats(aggregation)

    def throughput(self, aggregation: Aggregation) -> tuple[list[tuple[int, int]], bool]:
        return self.devices.throughput(aggregation)

    def cancel(self, aggregation_id: str) -> Aggregation:
        return self.lifecycle.cancel(aggregation_id)

    def ledger_ids(self) -> list[str]:
        return self.ledgers.ledger_ids()

    def ledger(self, ledger_id: str) -> dict | None:
        return self.ledgers.describe(ledger_id)

    def buffered_streams(self) -> list[dict]:
        described = []
        for stream in self.streams.all() if self.streams is not None else []:
            view = stream.describe()
            ledger = self.ledgers.describe(view["ledger_id"])
            view["ledger_epsilon"] = ledger["epsilon"] if ledger is not None else 0.0
            view["max_epsilon"] = ledger["max_epsilon"] if ledger is not None else None
            described.append(view)
        return described

    @staticmethod
    def _launcher(settings: Settings) -> HostLauncher:
        """What starts the shard hosts: local subprocesses (``--processes``; the public port is held here, bound
        and not listening, until they take it) or Ray actors (``--ray``)."""
        if settings.processes:
            from clipd.server.shards.launchers import LocalProcesses

            holder = reserve_port(settings.host, settings.grpc_port)
            launcher = LocalProcesses(settings, holder.getsockname()[1])
            launcher.port_holder = holder  # (kept open until the processes listen)
            return launcher
        from clipd.server.shards.ray_hosts import RayActors

        return RayActors(settings, settings.grpc_port)

    @property
    def data_plane_elsewhere(self) -> bool:
        """Shard hosts (``--processes``, ``--ray``) receive and sum; this process is the control plane."""
        return self.hosts is not None

    @property
    def serving(self) -> bool:
        """Ready for traffic: gRPC started, not stopping, and the device worker warmed up."""
        return not self.stopped.is_set() and self.devices.ready

    def stop(self, grace: float = 10.0) -> None:
        """Graceful: refuse new RPCs, let open streams finish for ``grace`` s, sum what was accepted."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        self._trimmer.stop()
        self.health.enter_graceful_shutdown()
        if self.data_plane_elsewhere:
            self.devices.stop(timeout=grace)  # they finish their streams (and may still call this process)
        self.grpc.stop(grace).wait(grace + 1.0)
        if self.streams is not None:  # the releases due are made, with what was summed
            self.streams.stop()
        if not self.data_plane_elsewhere:
            self.devices.stop(timeout=grace)
        self.store.close()
        if self.admin is not None:
            self.admin.stop()


def recover(store: Store, registry: Registry, shards: Shards, settings: Settings, ledgers: Ledgers) -> None:
    """Brings back every aggregation of the store as of its last checkpoint.

    Open ones warm up again and keep taking batches: their clients resume after
    their shard's checkpoint's sequence numbers (anything older is a duplicate); a private
    one reserves its release on its ledger again. Finalized ones serve their
    result (or their private release) again; failed ones keep their reason.
    """
    for record in store.records():
        spec = AggregationSpec.from_json(record.spec)
        shard_count, privacy = spec.shards, spec.privacy
        finalized = record.state == FINALIZED
        release: Release | None = None
        epochs: list[int | None] | None = None
        if privacy is not None and finalized:
            blob = store.load_release(record.aggregation_id)
            release = Release.from_bytes(blob) if blob is not None else None
            totals = None
        else:
            if claims_shards(store, settings, spec) and record.state not in (FINALIZED, FAILED):
                # Claim before reading: no earlier owner can commit after the checkpoints read here.
                epochs = [store.claim_shard(record.aggregation_id, k) for k in range(shard_count)]
            totals = [store.load_checkpoint(record.aggregation_id, shard=k, newest_only=finalized)
                      for k in range(shard_count)]
            if finalized and None in totals:
                totals = None  # a final checkpoint is missing or damaged: no result
        aggregation = Aggregation.from_record(record, settings, recovered=totals)
        if epochs is not None:
            aggregation.claimed(epochs)
        if finalized and (totals is not None or release is not None):
            aggregation.restore_result(record.finished, release)
        elif finalized:
            fail(aggregation, None, "the final checkpoint can't be read back")
        elif record.state == FAILED:  # restored as it was: no new fault, no event
            aggregation.fail(record.reason, finished=record.finished)
        else:
            if privacy is not None:
                assert aggregation.plan is not None  # a private aggregation's release plan
                ledgers.reserve(aggregation, privacy, aggregation.plan)
            shards.warm_up(aggregation)
            if record.state == CLOSING:  # a finalize was under way: it takes no more batches
                aggregation.close()
        registry.add(aggregation)
        event(log, "aggregation.recovered", aggregation=record.aggregation_id, state=aggregation.state.value,
              examples=aggregation.examples)


def create_server(settings: Settings) -> tuple[ClipdServer, int]:
    """A started server and the port it listens on (``grpc_port=0`` picks a free one)."""
    server = ClipdServer(settings).start()
    return server, server.port


SHUTDOWN_MARGIN = 5.0  # seconds past the grace period after which the process exits regardless


def serve(settings: Settings, grace: float | None = None) -> None:
    """Runs until SIGINT or SIGTERM, stops gracefully, and exits the process.

    Open streams get ``grace`` seconds to finish; accepted batches are summed
    and checkpointed. The process then ends with ``os._exit``, and ends anyway
    ``SHUTDOWN_MARGIN`` seconds after the grace period if stopping is stuck:
    no half-dead RPC thread can keep it alive (what is acknowledged is on disk).
    """
    grace = settings.shutdown_grace if grace is None else grace
    server, port = create_server(settings)
    _process.settle()  # what start-up made is left out of the garbage collector's scans (clipd/_process.py)
    # A plain flag, polled: the handler takes no lock (an Event's set() from a signal handler takes its
    # condition's lock, which the interrupted main thread may be holding), and the main thread's sleep is
    # interrupted by the signal, so the handler runs at once.
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    admin = f", admin API on {server.admin.scheme}://{settings.host}:{server.admin.port}" if server.admin else ""
    print(f"clipd serving gRPC on {settings.host}:{port}{admin}", flush=True)
    while not stop:
        time.sleep(0.2)
    log.info("stopping (grace %g s)", grace, extra={"event": "server.stopping"})
    stopper = threading.Thread(target=server.stop, args=(grace,), name="clipd-stop", daemon=True)
    stopper.start()
    stopper.join(grace + SHUTDOWN_MARGIN)
    if stopper.is_alive():
        log.error("shutdown did not finish within %g s; exiting anyway", grace + SHUTDOWN_MARGIN)
    else:
        log.info("stopped", extra={"event": "server.stopped"})
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(1 if stopper.is_alive() else 0)
