"""Shard hosts on a Ray cluster (``clipd serve --ray HOST:PORT``): the shard processes of ``--processes``,
each a Ray actor on a node of the cluster, receiving and summing their own shards.

``pip install '.[server,postgres,ray]'`` (Ray 2.60+): the hosts checkpoint into the shared PostgreSQL
store. The clipd server is the control plane (Create, GetStats, Finalize, ledgers, the admin API) and never
sees a payload byte: clients stream to ``ray_ingest_port`` on any node (the hosts of a node share it) or,
routed by ``GetPlacement``, to the host of their shard. A host is a
:class:`~clipd.server.shards.host.ShardHost`, so it takes the data plane's every path (large updates
streamed into the sum, resumes, secure sums) and its faults are handled the same way: Ray restarts a host
that dies, which claims its shards' epochs and opens its aggregations from their checkpoints; its clients
resume after their last acknowledgement.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

try:
    import ray
    import ray.util
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "clipd.server.shards.ray_hosts needs Ray: pip install '.[ray]' (ray>=2.60,<3)"
    ) from e

import grpc

from clipd.server.errors import ClipdError, Unavailable
from clipd.server.internal.v1 import shard_host_pb2 as host_pb
from clipd.server.shards.protocol import CALLS, host_error

__all__ = ["RayActors", "cluster_address"]


def cluster_address(host: str) -> str:
    """How the cluster's nodes reach this host: ``host``, or this node's address when it is a wildcard."""
    return ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "[::]", "") else host


# Shard hosts: receive and sum on the cluster's nodes ----------------------------------------------
class _HostActor:
    """A shard process on a Ray node (``--ray-shard-hosts N``): it receives, clips and sums its own shards.

    The same :class:`clipd.server.shards.host.ShardHost` as ``--processes`` runs, with TCP instead of unix
    sockets: clients connect to ``ray_ingest_port`` on any node (or, routed, to the host's own port), a Submit
    for another host's shard goes to that host's own port, every other call to the clipd server. The server's
    calls (open, finish, statistics, forget) are this actor's :meth:`call`. Ray restarts a dead host, which
    opens its aggregations from the shared store again.
    """

    def __init__(self, fields: dict, index: int, control: str) -> None:
        from clipd.server.settings import Settings
        from clipd.server.shards.host import ShardHost

        settings = Settings(**fields)
        self.host = cluster_address(settings.advertise_host or settings.host)  # as clients and hosts reach it
        self.process = ShardHost(settings, index, settings.ray_ingest_port, 0, None, control=control).start()
        self.process.handle("Serve", host_pb.ServeRequest())

    def endpoint(self) -> str:
        return f"{self.host}:{self.process.data_port}"

    def set_siblings(self, targets: dict) -> None:
        """The other hosts' endpoints (index -> host:port): where this one forwards, and its GetPlacement answer."""
        siblings = {int(i): t for i, t in targets.items()}
        self.process.set_siblings(siblings)
        every = {**siblings, self.process.index: self.endpoint()}
        self.process.set_placement([every.get(i, "") for i in range(self.process.count)])

    def call(self, name: str, request: bytes) -> tuple[str, str, bytes]:
        """One of the control's calls (the ShardHost service, ``CALLS``), serialized both ways:
        ``("", "", answer)``, or ``(status code name, message, b"")`` if the host refused it."""
        request_type, _ = CALLS[name]
        try:
            return "", "", self.process.handle(name, request_type.FromString(request)).SerializeToString()
        except ClipdError as e:
            return e.code.name, str(e), b""

    def pid(self) -> int:
        return os.getpid()


# Several calls at once: a long Open or Finish must not hold up the server's endpoint and pid checks.
# (Ray's overloads of ray.remote(...) list the options of a remote function only, not an actor's.)
HostActor = ray.remote(  # type: ignore[call-overload]
    max_restarts=-1, max_task_retries=0, num_cpus=0.25, max_concurrency=16)(_HostActor)


class RayActors:
    """Shard hosts as Ray actors, one a node (``--ray-shard-hosts N``, or one on each node): the
    :class:`~clipd.server.shards.hosts.HostLauncher` of ``--ray``. Ray places them (spread over the nodes, with
    ``ray_gpus_per_host`` GPUs each) and restarts one that dies; the control's calls are actor calls."""

    def __init__(self, settings, port: int) -> None:
        import dataclasses

        self.settings, self.port = settings, port
        if not ray.is_initialized():
            ray.init(address=settings.ray_address, log_to_driver=False)
        # As many as asked for, or one on each node of the cluster.
        self.count = settings.ray_shard_hosts or sum(1 for node in ray.nodes() if node.get("Alive"))
        self.control = ""  # the server's address as the nodes reach it (set once its port is bound)
        self.control_address: str | None = None  # the server listens on its public port (the hosts reach it there)
        self.actors: list = []
        self._endpoints = [""] * self.count
        self._pids: list = [None] * self.count
        self._served = [False] * self.count
        self.restarts = [0] * self.count
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="clipd-hosts-watch", daemon=True)
        # What a host needs: the store, limits, the admin token (Submit's check), its count and port.
        self._fields = dataclasses.asdict(dataclasses.replace(
            settings, ray_address="", ray_shard_hosts=0, processes=self.count))

    def reach_control_at(self, host: str, port: int) -> None:
        """The server's address as the cluster's nodes reach it (this node's address for a wildcard host)."""
        self.control = f"{cluster_address(host)}:{port}"

    def start(self) -> None:
        """Creates the actors and returns once each answers (its endpoint and pid); then watches them."""
        options: dict[str, Any] = dict(scheduling_strategy="SPREAD")
        if self.settings.ray_gpus_per_host:
            options["num_gpus"] = self.settings.ray_gpus_per_host
        self.actors = [HostActor.options(**options).remote(self._fields, i, self.control) for i in range(self.count)]
        self._refresh(timeout=300)
        self._watcher.start()

    def _refresh(self, timeout: float = 30) -> bool:
        """Reads every host's endpoint and pid; tells them each other's endpoints if one moved. True if all answer."""
        answers: list[list[Any] | None] = []  # [endpoint, pid], None: no answer
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

    def call(self, index: int, name: str, request, timeout: float):
        """One of the control's calls to host ``index``, serialized through its actor (:class:`HostLauncher`)."""
        try:
            code, message, answer = ray.get(self.actors[index].call.remote(name, request.SerializeToString()),
                                            timeout=timeout)
        except Exception as e:  # the actor died or is being restarted, or the call timed out
            raise Unavailable(f"shard host {index}: {type(e).__name__}") from None
        if code:
            raise host_error(f"shard host {index}", grpc.StatusCode[code], message)
        return CALLS[name][1].FromString(answer)

    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._endpoints)

    def processes(self) -> list[dict]:
        with self._lock:
            return [{"index": i, "pid": self._pids[i], "alive": self._served[i], "serving": self._served[i],
                     "restarts": self.restarts[i], "endpoint": self._endpoints[i]} for i in range(self.count)]

    @property
    def ready(self) -> bool:
        with self._lock:
            return all(self._served)

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
