"""Shards of an aggregation as Ray actors that checkpoint to a shared store under a fencing epoch.

``pip install 'clipd[ray]'`` (Ray 2.60+) and ``clipd[postgres]`` for the store.

Each shard of an aggregation is owned by one :class:`ShardOwner`: it sums the
clipped batches sent to that shard (exactly once per client, by sequence
number) and commits its totals to the store after every batch, under the
epoch it claimed with :meth:`~clipd.server.stores.base.Store.claim_shard`. A
:class:`ShardActor` is a ShardOwner in a Ray actor that Ray restarts after a
crash (``max_restarts=-1``); the restarted actor runs its constructor again:
it claims a newer epoch and restores the shard from the store's checkpoint.

Exactly once, end to end:

- A batch is acknowledged (``submit`` returns) only once the checkpoint that
  covers it is committed, so an acknowledged batch survives any crash.
- A batch that was not acknowledged (the actor died with the call in flight:
  ``max_task_retries=0``, Ray does not resend it) is resent by the driver
  (:func:`call_until_answered`). The restored owner knows, for every client, the
  highest sequence its totals cover: a resent batch it already summed is a
  duplicate (a no-op that returns the durable mark), a gap is refused.
- Fencing: an owner believed dead may still run (a stopped process, a
  partitioned node). Once a replacement claims the shard, every checkpoint of
  the old owner is refused by the store (``FencedOut``): nothing it summed
  after that can land, and it refuses every later call. A fenced actor raises
  ``FencedOut`` to its callers (``ray.get`` raises an exception that is both a
  ``RayTaskError`` and a ``FencedOut``); it does not exit, since Ray would
  restart it and the restart would claim the shard back from its replacement.
  Kill it with ``ray.kill(actor, no_restart=True)``.

The last owner to claim the shard wins: run one actor per shard (a named,
detached actor is a good way to make that so), and let Ray's restarts, not a
second actor, replace it.

Placement: ``ShardActor`` asks for ``num_cpus=0.5`` by default (fine for a test
cluster and for the CPU backend). On a GPU cluster give each shard a device of
its own: ``ShardActor.options(num_gpus=1).remote(...)`` or
``shard_actor(..., num_gpus=1)``; Ray sets ``CUDA_VISIBLE_DEVICES`` for the
actor and JAX uses that GPU.

Each batch is one jitted step (one compile per distinct batch row count);
``submit_many`` sums several batches and commits them as one checkpoint (the
server's link sends every batch waiting in one call: group commit).

Example (a driver; see tests/test_ray.py)::

    ray.init(address=...)
    store = PostgresStore(dsn)
    store.create(AggregationRecord("agg", spec_json))
    actor = shard_actor(dsn, "agg", 0, spec_json)
    for sequence, arrays in enumerate(batches, 1):
        call_until_answered(lambda: actor.submit.remote("alice", "writer-1", sequence, arrays))
    totals = PartialState.from_bytes(ray.get(actor.totals_bytes.remote()))
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np

try:
    import ray
    import ray.exceptions
    import ray.util
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "clipd.server.shards.ray_actors needs Ray: pip install 'clipd[ray]' (ray>=2.60,<3)"
    ) from e

import jax

from clipd.engine import PartialState
from clipd.server.aggregations import make_accumulator, spec_from_json, spec_shards
from clipd.server.errors import DeadlineExceeded, FailedPrecondition
from clipd.server.lifecycle import fail
from clipd.server.shards.process import ShardProcesses
from clipd.server.stores.base import FencedOut, Store

__all__ = ["ShardOwner", "ShardActor", "shard_actor", "call_until_answered", "FencedOut", "RayShards"]


class ShardOwner:
    """One shard of one aggregation: sums its batches exactly once per client, checkpoints every batch.

    ``__init__`` claims the shard (a new epoch: every earlier owner is fenced
    out from then on), then restores the shard's totals from the store's
    newest checkpoint (empty if there is none). The aggregation must exist in
    the store (``KeyError`` otherwise).
    """

    def __init__(self, store: Store, aggregation_id: str, shard: int, spec_json: str) -> None:
        layers, policy, _reject_non_finite, privacy = spec_from_json(spec_json)
        shards = spec_shards(spec_json)
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard}: the aggregation has {shards} shard(s)")
        self.store = store
        self.aggregation_id = aggregation_id
        self.shard = int(shard)
        self.layers = layers
        plan = privacy.plan(policy.example_bound(layers), layers) if privacy is not None else None
        self.accumulator = make_accumulator(layers, policy, plan)
        self._fenced: FencedOut | None = None
        # Claim first, then read: no earlier owner can commit after the checkpoint we restore.
        self.epoch = store.claim_shard(aggregation_id, self.shard)
        self.totals = store.load_checkpoint(aggregation_id, shard=self.shard) or PartialState.empty(layers)

    # Queries ------------------------------------------------------------------------------
    def mark(self, client_id: str) -> int:
        """The highest sequence of ``client_id`` the committed totals cover (0: none)."""
        return int(self.totals.clients.get(client_id, (0, ""))[0])

    def totals_bytes(self) -> bytes:
        """The committed totals (``PartialState.to_bytes``)."""
        return self.totals.to_bytes()

    def pid(self) -> int:
        return os.getpid()

    def get_epoch(self) -> int:
        return self.epoch

    # Ingest -------------------------------------------------------------------------------
    def submit(self, client_id: str, writer_id: str, sequence: int, arrays: Sequence[np.ndarray]) -> int:
        """Sums one batch of ``client_id`` and commits; returns the client's durable sequence.

        ``arrays[k]``: shape ``(rows, *layers[k].shape)``. ``sequence <= mark``:
        a duplicate (nothing summed; the durable mark is returned). A sequence
        other than ``mark + 1``: ``ValueError`` (a gap). ``FencedOut``: a newer
        owner claimed the shard; this owner refuses every later call.
        """
        return self.submit_many([(client_id, writer_id, sequence, arrays)])[0]

    def submit_many(self, batches: Sequence[tuple[str, str, int, Sequence[np.ndarray]]]) -> list[int]:
        """:meth:`submit` for several ``(client_id, writer_id, sequence, arrays)`` batches, with one commit.

        Returns each batch's client's durable sequence. A gap anywhere commits nothing (``ValueError``).
        """
        self._check_not_fenced()
        totals, durable = self.totals, []
        for client_id, writer_id, sequence, arrays in batches:
            sequence = int(sequence)
            mark = int(totals.clients.get(client_id, (0, ""))[0])
            if sequence <= mark:
                durable.append(mark)
                continue
            if sequence != mark + 1:
                raise ValueError(f"client {client_id!r}: sequence {sequence} after {mark} (a gap; "
                                 f"the next batch must be {mark + 1})")
            batch = self._batch(arrays)
            delta = self.accumulator.update(self.accumulator.init(), batch, np.ones(batch[0].shape[0], bool))
            totals = totals.absorb(jax.device_get(delta), {client_id: (sequence, writer_id)}, 1,
                                   sum(a.nbytes for a in batch))
            durable.append(sequence)
        if totals is not self.totals:
            try:
                self.store.save_checkpoint(self.aggregation_id, totals, shard=self.shard, epoch=self.epoch)
            except FencedOut as e:
                self._fenced = e
                raise
            self.totals = totals
        return durable

    def _check_not_fenced(self) -> None:
        if self._fenced is not None:
            raise FencedOut(f"aggregation {self.aggregation_id!r} shard {self.shard}: this owner (epoch "
                            f"{self.epoch}) was fenced out: {self._fenced}")

    def _batch(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        if len(arrays) != len(self.layers):
            raise ValueError(f"{len(arrays)} arrays for {len(self.layers)} layers")
        batch, rows = [], None
        for layer, array in zip(self.layers, arrays):
            array = np.ascontiguousarray(array, dtype=layer.dtype)
            if array.ndim != 1 + len(layer.shape) or tuple(array.shape[1:]) != tuple(layer.shape):
                raise ValueError(f"layer {layer.name!r}: shape {array.shape}, expected (rows, *{layer.shape})")
            if rows is None:
                rows = array.shape[0]
            elif array.shape[0] != rows:
                raise ValueError(f"layer {layer.name!r}: {array.shape[0]} rows, other layers have {rows}")
            batch.append(array)
        if not rows:
            raise ValueError("a batch needs at least one row")
        return batch


class _ShardActor(ShardOwner):
    """A ShardOwner on a ``PostgresStore(dsn)`` of its own (the actor's process opens it)."""

    def __init__(self, dsn: str, aggregation_id: str, shard: int, spec_json: str) -> None:
        from clipd.server.stores.postgres import PostgresStore

        super().__init__(PostgresStore(dsn), aggregation_id, shard, spec_json)


# Restarted by Ray after a crash (forever); a call in flight when it died is not retried by Ray
# (max_task_retries=0): the driver resends it (call_until_answered), and the restored owner recognizes
# a batch it already committed.
ShardActor = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0.5)(_ShardActor)


def shard_actor(dsn: str, aggregation_id: str, shard: int, spec_json: str, *, num_cpus: float = 0.5,
                num_gpus: float = 0, name: str | None = None, **options):
    """Starts the actor of one shard. ``num_gpus=1`` on a GPU cluster: the shard gets a device of its own."""
    if name is not None:
        options["name"] = name
    return ShardActor.options(num_cpus=num_cpus, num_gpus=num_gpus, **options).remote(
        dsn, aggregation_id, shard, spec_json)


_RETRIABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def call_until_answered(call, *, timeout: float = 120.0, call_timeout: float | None = 60.0,
                        backoff: float = 0.2):
    """``ray.get(call())``, made again while the actor is dead or restarting; ``TimeoutError`` after ``timeout`` s.

    A call that fails because the actor died or is restarting (``RayActorError``,
    ``ActorUnavailableError``) is made again once Ray has restarted it: the new
    actor restored the shard from the store, so a batch that was committed
    before the crash comes back as a duplicate and is not summed twice. Any
    other error (``FencedOut``, ``ValueError`` for a gap) is raised at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(call(), timeout=call_timeout)
        except _RETRIABLE as e:
            if time.monotonic() + backoff > deadline:
                raise TimeoutError(f"the actor did not come back within {timeout:g} s: {e}") from e
            time.sleep(backoff)
            backoff = min(2 * backoff, 2.0)



# The server's side: clipd serve --ray ADDRESS ---------------------------------------------------
class _ShardLink:
    """The server's link to one shard actor: sends the shard's batches in order and acknowledges them.

    Each call carries every batch waiting (up to ``group``), summed and
    committed by the actor as one checkpoint (group commit); up to ``window``
    calls are in flight at once (Ray runs one caller's calls on an actor in
    order). If the actor dies, Ray restarts it (it restores the shard from the
    store) and every call in flight is sent again, in order: batches it had
    already committed come back as duplicates.
    """

    def __init__(self, aggregation, shard: int, actor, store: Store, window: int, group: int) -> None:
        self.aggregation, self.shard, self.actor, self.store = aggregation, shard, actor, store
        self.window, self.group = window, group
        self.batches = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._send, name=f"clipd-ray-{aggregation.id}-{shard}", daemon=True)
        self._thread.start()

    def put(self, client: str, writer: str, batch) -> None:
        self._queue.put((client, writer, batch))

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        self._queue.put(None)

    def _call(self, items):
        return self.actor.submit_many.remote([(c, w, b.sequence, b.layers) for c, w, b in items])

    def _take(self, block: bool) -> tuple[list, bool]:
        """The batches waiting (at most ``group``; waits for one if ``block``), and whether the link is closed."""
        items: list = []
        while len(items) < self.group:
            try:
                item = self._queue.get(block=block and not items)
            except queue.Empty:
                break
            if item is None:
                return items, True
            if self.aggregation.state.value in ("cancelled", "failed"):
                self._drop([item])
            else:
                items.append(item)
        return items, False

    def _send(self) -> None:
        inflight: collections.deque = collections.deque()  # (items, ObjectRef), oldest first
        closed = False
        while not closed or inflight:
            while not closed and len(inflight) < self.window:  # fill the window
                items, closed = self._take(block=not inflight)
                if not items:
                    break
                inflight.append((items, self._call(items)))
            if not inflight:
                continue
            items, ref = inflight.popleft()
            try:
                try:
                    durable = ray.get(ref, timeout=120)
                except _RETRIABLE:  # the actor died: these again (until it is back), then every later call
                    durable = call_until_answered(lambda: self._call(items))
                    inflight = collections.deque((later, self._call(later)) for later, _ in inflight)
            except Exception as e:  # FencedOut, a gap, the actor gone for good: the aggregation fails
                self._drop([*items, *(it for later, _ in inflight for it in later)])
                inflight.clear()
                self._fail(f"shard {self.shard}: {type(e).__name__}: {e}")
                continue
            self._acknowledge(items, durable)
            del items, durable  # the batches' buffers go now, not at the next

    def _acknowledge(self, items, durable: list[int]) -> None:
        for (client, writer, batch), mark in zip(items, durable):
            batch.release()
            self.batches += 1
            self.aggregation.record([(client, writer, batch.sequence, batch.rows, batch.nbytes)], None, self.shard)
            self.aggregation.mark_durable({client: (mark, writer)})

    def _drop(self, items) -> None:
        for _, _, batch in items:
            batch.release()
            self.aggregation.drop(1)

    def _fail(self, reason: str) -> None:
        fail(self.aggregation, self.store, reason)


class RayShards:
    """Every shard of every aggregation as a :class:`ShardActor` on a Ray cluster (``clipd serve --ray ADDRESS``).

    The same calls as :class:`clipd.server.shards.local.Devices`, so the servicer is
    the same: a batch goes to its client's shard actor, which sums it and
    commits the shard's checkpoint to the shared store (PostgreSQL) before the
    stream acknowledges it. Ray restarts a dead actor, which restores its
    shard from the store; the link resends what was not acknowledged. Finalize
    reads every shard's committed totals and merges them. ``gpus_per_shard=1``
    places each shard actor on a GPU of its own.
    """

    link_window = 4  # calls in flight per shard actor
    link_group = 64  # batches per call at most (one checkpoint commit in the actor)

    def __init__(self, address: str, dsn: str, store: Store, shards: int = 0, gpus_per_shard: float = 0) -> None:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        self.dsn, self.store, self.gpus_per_shard = dsn, store, gpus_per_shard
        gpus = int(ray.cluster_resources().get("GPU", 0))
        self.shards = shards or (gpus if gpus_per_shard and gpus else max(1, len(ray.nodes())))
        self._links: dict = {}  # aggregation -> [_ShardLink per shard]
        self._lock = threading.Lock()

    def endpoints(self) -> list[str]:
        """Clients reach the shard actors through this server's port (or its ingest actors)."""
        return []

    def __len__(self) -> int:
        return self.shards

    def warm_up(self, aggregation) -> None:
        """Starts the aggregation's shard actors (each claims its shard and restores it), then opens it."""
        from clipd.server.aggregations import spec_to_json

        spec = spec_to_json(aggregation.layers, aggregation.policy, aggregation.reject_non_finite,
                            aggregation.privacy, aggregation.shards)
        actors = [shard_actor(self.dsn, aggregation.id, s, spec, num_gpus=self.gpus_per_shard)
                  for s in range(aggregation.shards)]
        with self._lock:
            self._links[aggregation] = [_ShardLink(aggregation, s, a, self.store, self.link_window, self.link_group)
                                        for s, a in enumerate(actors)]
        aggregation.mark_open()

    def submit(self, aggregation, client: str, writer: str, batch) -> None:
        with self._lock:  # under the lock: a batch can't slip in behind a closed link (forget)
            links = self._links.get(aggregation)
            if links is None:
                raise FailedPrecondition(f"aggregation {aggregation.id} takes no more batches")
            links[aggregation.shard_of(client)].put(client, writer, batch)

    def commit_final(self, aggregation, timeout: float | None = None) -> list[PartialState]:
        """Every shard's committed totals (every accepted batch is in: the caller waited for them).

        Each is committed again as the shard's final checkpoint, so a shard that
        never had a batch (no checkpoint of its actor) has one too: a restarted
        server finds every shard of a finalized aggregation.
        """
        with self._lock:
            links = list(self._links[aggregation])
        try:
            blobs = ray.get([link.actor.totals_bytes.remote() for link in links], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise DeadlineExceeded(f"aggregation {aggregation.id}: the shard actors did not answer within"
                                   f" {timeout:g} s") from None
        totals = [PartialState.from_bytes(blob) for blob in blobs]
        self.forget(aggregation)  # the actors go: nothing more is summed, so the claims need not hold
        for shard, state in enumerate(totals):
            self.store.save_checkpoint(aggregation.id, state, shard=shard)
        return totals

    def forget(self, aggregation) -> None:
        with self._lock:
            links = self._links.pop(aggregation, [])
        for link in links:
            link.close()
            ray.kill(link.actor, no_restart=True)

    def finished(self, aggregation) -> None:
        """Nothing to drop: :meth:`commit_final` let the aggregation's actors go."""

    @property
    def ready(self) -> bool:
        return ray.is_initialized()

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return sum(link.depth for links in self._links.values() for link in links)

    queued_bytes = 0  # batches wait in the links' queues; their bytes are in the server's buffer budget

    @property
    def device_kind(self) -> str:
        return "ray"

    def describe(self) -> list[dict]:
        """Each open aggregation's shard actors and the batches each has summed."""
        with self._lock:
            links = [link for links in self._links.values() for link in links]
        return [{"id": f"{link.aggregation.id}/{link.shard}", "kind": "ray-shard-actor", "platform": "ray",
                 "steps": link.batches} for link in links]

    def stop(self, timeout: float | None = None) -> None:
        with self._lock:
            links = [link for links in self._links.values() for link in links]
        for link in links:
            link.close()


# Ingest endpoints on the cluster ------------------------------------------------------------------
class _IngestActor:
    """An ingest endpoint on a Ray node: clients connect to it, it forwards every RPC to the clipd server.

    A :class:`clipd.server.shards.ingest.IngestServer`: it terminates the clients'
    connections on this node and passes each call through.
    Several on one node share the port (SO_REUSEPORT).
    """

    def __init__(self, settings: dict, owner: str, index: int) -> None:
        from clipd.server.settings import Settings
        from clipd.server.shards.ingest import IngestServer

        self.server = IngestServer(Settings(**settings), settings["ray_ingest_port"], owner, index).start()

    def address(self) -> str:
        return f"{ray.util.get_node_ip_address()}:{self.server.port}"

    def pid(self) -> int:
        return os.getpid()


IngestActor = ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0.25)(_IngestActor)


def cluster_address(host: str) -> str:
    """How the cluster's nodes reach this host: ``host``, or this node's address when it is a wildcard."""
    return ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "[::]", "") else host


class RayIngest:
    """The server's ingest actors, spread over the cluster's nodes (``--ray-ingest-actors N``)."""

    def __init__(self, settings, owner: str) -> None:
        import dataclasses

        # What an endpoint needs (limits, TLS, the ports), not the admin credential nor the store's URL.
        fields = dataclasses.asdict(dataclasses.replace(settings, admin_token="", insecure=True, data_dir="memory",
                                                        ray_address="", ray_ingest_actors=0))
        fields["ray_ingest_port"] = settings.ray_ingest_port
        self.actors = [IngestActor.options(scheduling_strategy="SPREAD").remote(fields, owner, i)
                       for i in range(settings.ray_ingest_actors)]
        self.addresses = ray.get([a.address.remote() for a in self.actors], timeout=120)

    def describe(self) -> list[dict]:
        out = []
        for index, (actor, address) in enumerate(zip(self.actors, self.addresses)):
            try:
                pid, alive = ray.get(actor.pid.remote(), timeout=5), True
            except Exception:  # dead, or being restarted by Ray
                pid, alive = None, False
            out.append({"index": index, "pid": pid, "alive": alive, "address": address})
        return out

    def stop(self, grace: float) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


# Shard hosts: receive and sum on the cluster's nodes ----------------------------------------------
class _ShardHost:
    """A shard process on a Ray node (``--ray-shard-hosts N``): it receives, clips and sums its own shards.

    The same :class:`clipd.server.shards.process.ShardProcess` as ``--processes`` runs, with TCP instead of unix
    sockets: clients connect to ``ray_ingest_port`` on any node (or, routed, to the host's own port), a Submit
    for another host's shard goes to that host's own port, every other call to the clipd server. The server's
    calls (open, finish, statistics, forget) are this actor's :meth:`call`. Ray restarts a dead host, which
    opens its aggregations from the shared store again.
    """

    def __init__(self, fields: dict, index: int, control: str) -> None:
        from clipd.server.settings import Settings
        from clipd.server.shards.process import ShardProcess

        settings = Settings(**fields)
        self.host = cluster_address(settings.advertise_host or settings.host)  # as clients and hosts reach it
        self.process = ShardProcess(settings, index, settings.ray_ingest_port, 0, None, control=control).start()
        self.process.call("Serve", {})

    def endpoint(self) -> str:
        return f"{self.host}:{self.process.data_port}"

    def set_siblings(self, targets: dict) -> None:
        """The other hosts' endpoints (index -> host:port): where this one forwards, and its GetPlacement answer."""
        siblings = {int(i): t for i, t in targets.items()}
        self.process.set_siblings(siblings)
        every = {**siblings, self.process.index: self.endpoint()}
        self.process.set_placement([every.get(i, "") for i in range(self.process.count)])

    def call(self, name: str, request: dict) -> dict:
        return self.process.call(name, request)

    def pid(self) -> int:
        return os.getpid()


# Several calls at once: a long Open or Finish must not hold up the server's endpoint and pid checks.
ShardHost = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0.25, max_concurrency=16)(_ShardHost)


class RayShardHosts(ShardProcesses):
    """The server's shard hosts on a Ray cluster: the calls of :class:`~clipd.server.shards.process.ShardProcesses`
    over actors instead of child processes (placement, finalize, statistics are the same)."""

    def __init__(self, settings, store: Store, port: int) -> None:
        import dataclasses

        from clipd.server.errors import Unavailable

        self._unavailable = Unavailable
        self.settings, self.store, self.port = settings, store, port
        self.count = settings.ray_shard_hosts
        self.control = ""  # the server's address as the nodes reach it (set once its port is bound)
        self.actors: list = []
        self._endpoints = [""] * self.count
        self._pids: list = [None] * self.count
        self._served = [False] * self.count
        self.restarts = [0] * self.count
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._started = False
        self.registry = None
        self._seen: dict = {}
        self._empty: dict = {}
        self._threads = [threading.Thread(target=self._watch, name="clipd-hosts-watch", daemon=True),
                         threading.Thread(target=self._pump, name="clipd-hosts-stats", daemon=True)]
        # What a host needs: the store, limits, the admin token (Submit's check), its count and port.
        self._fields = dataclasses.asdict(dataclasses.replace(
            settings, ray_address="", ray_shard_hosts=0, processes=settings.ray_shard_hosts))
        if not ray.is_initialized():
            ray.init(address=settings.ray_address, log_to_driver=False)

    def start(self, registry) -> RayShardHosts:
        self.registry = registry
        options = dict(scheduling_strategy="SPREAD")
        if self.settings.ray_gpus_per_shard:
            options["num_gpus"] = self.settings.ray_gpus_per_shard
        self.actors = [ShardHost.options(**options).remote(self._fields, i, self.control) for i in range(self.count)]
        self._refresh(timeout=300)
        self._started = True
        for thread in self._threads:
            thread.start()
        return self

    def _refresh(self, timeout: float = 30) -> bool:
        """Reads every host's endpoint and pid; tells them each other's endpoints if one moved. True if all answer."""
        answers = []
        for actor in self.actors:
            try:
                answers.append(ray.get([actor.endpoint.remote(), actor.pid.remote()], timeout=timeout))
            except Exception:  # dead, or being restarted by Ray
                answers.append(None)
        with self._lock:
            moved = False
            for index, answer in enumerate(answers):
                if answer is None:
                    self._served[index] = False
                    continue
                endpoint, pid = answer
                if pid != self._pids[index]:
                    if self._pids[index] is not None:
                        self.restarts[index] += 1
                    moved = True
                self._endpoints[index], self._pids[index], self._served[index] = endpoint, pid, True
            endpoints = dict(enumerate(self._endpoints))
        if moved:
            for index, actor in enumerate(self.actors):
                with contextlib.suppress(Exception):
                    ray.get(actor.set_siblings.remote({i: e for i, e in endpoints.items() if i != index and e}),
                            timeout=timeout)
        return all(a is not None for a in answers)

    def _watch(self) -> None:
        while not self._stopping.wait(1.0):
            with contextlib.suppress(Exception):
                self._refresh(timeout=5)

    def _transport(self, index: int, name: str, request: dict, timeout: float) -> dict:
        try:
            return ray.get(self.actors[index].call.remote(name, request), timeout=timeout)
        except Exception as e:  # the actor died or is being restarted, or the call timed out
            raise self._unavailable(f"shard host {index}: {type(e).__name__}") from None

    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._endpoints)

    def describe_processes(self) -> list[dict]:
        with self._lock:
            return [{"index": i, "pid": self._pids[i], "alive": self._served[i], "serving": self._served[i],
                     "restarts": self.restarts[i], "endpoint": self._endpoints[i]} for i in range(self.count)]

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
