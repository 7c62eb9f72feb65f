"""Shard hosts as local subprocesses (``clipd serve --processes N``): the launcher of
:class:`~clipd.server.shards.hosts.ShardHosts` that starts, calls, watches and stops them.

Each is a new interpreter (``python -m clipd.server.shards.host``; not a fork: the control process has gRPC and
JAX threads) that reads its orders as one JSON line on stdin, answers ``ready <port>`` once it listens, and takes
the control's calls on a unix socket in a private directory (0700). One that exits is started again on its port;
one that can't be told to serve is killed and started again (never two live owners of the same shards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc

from clipd.server.internal.v1 import shard_host_pb2 as host_pb
from clipd.server.internal.v1 import shard_host_pb2_grpc as host_grpc
from clipd.server.settings import Settings
from clipd.server.shards.host import socket_path
from clipd.server.shards.protocol import host_error

log = logging.getLogger(__name__)


def _gpu_count() -> int:
    return sum(1 for name in os.listdir("/dev") if name.startswith("nvidia") and name[6:].isdigit()) \
        if os.path.isdir("/dev") else 0


def child_environment(index: int, processes: int, environ=os.environ) -> dict[str, str]:
    """A shard process's environment: its GPU (one each when there are enough), its share of GPU memory.

    >>> env = child_environment(1, 4, {})
    >>> env["XLA_PYTHON_CLIENT_PREALLOCATE"], env["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    ('false', '0.225')
    """
    env = dict(environ)
    gpus = _gpu_count()
    if gpus >= processes and "CUDA_VISIBLE_DEVICES" not in environ:
        env["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
    sharing = processes if gpus < processes else 1  # processes on one GPU
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / sharing:.3f}")
    return env


class LocalProcesses:
    """N shard processes on this host (a :class:`~clipd.server.shards.hosts.HostLauncher`)."""

    def __init__(self, settings: Settings, port: int) -> None:
        """``port``: the public port they share (held by the control, bound, until they listen on it)."""
        self.settings, self.port = settings, port
        self.count = settings.processes
        self.private_dir = tempfile.mkdtemp(prefix="clipd-shards-")  # 0700: the sockets are private
        self.data_ports = [settings.shard_ports + i if settings.shard_ports else 0 for i in range(self.count)]
        self._processes: list[subprocess.Popen | None] = [None] * self.count
        self._served = [False] * self.count
        self._told: list[str] = []  # the endpoints the serving shard processes answer GetPlacement with
        self.restarts = [0] * self.count
        self._channels = [grpc.insecure_channel(f"unix:{socket_path(self.private_dir, i)}") for i in range(self.count)]
        self._hosts = [host_grpc.ShardHostStub(channel) for channel in self._channels]
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="clipd-shards-watch", daemon=True)
        # Where the control process listens for the processes' calls (they take the public port).
        self.control_address: str | None = f"unix:{os.path.join(self.private_dir, 'control.sock')}"
        self.port_holder: socket.socket | None = None  # holds the public port until the processes listen on it

    # Starting and watching -----------------------------------------------------------------------------
    def _spawn(self, index: int, timeout: float = 120.0) -> bool:
        """A new interpreter (not a fork: this process has gRPC and JAX threads); True once it is ready."""
        process = subprocess.Popen([sys.executable, "-m", "clipd.server.shards.host"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=child_environment(index, self.count))
        orders = {"settings": dataclasses.asdict(self.settings), "port": self.port, "index": index,
                  "data_port": self.data_ports[index], "private_dir": self.private_dir}
        stdin, stdout = process.stdin, process.stdout
        assert stdin is not None and stdout is not None  # (PIPE both)
        with contextlib.suppress(OSError):
            stdin.write(json.dumps(orders) + "\n")
            stdin.close()
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(stdout.readline()), name="clipd-shard-ready",
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        failed = not answer or not answer[0].startswith("ready ")
        with self._lock:
            self._processes[index] = process
            stopping = self._stopping.is_set()
            if failed and not stopping:
                self.restarts[index] += 1  # a start-up retry is a restart too
        if stopping or failed:
            with contextlib.suppress(OSError):
                process.kill()
            process.wait()
            log.warning("shard process %d did not start (exit status %s); trying again", index, process.returncode,
                        extra={"event": "shard_process.start_failed"})
            if self.data_ports[index] and not self.settings.shard_ports:
                self.data_ports[index] = 0  # its old port may be taken: any free one (clients ask again)
            return False
        stdout.close()
        self.data_ports[index] = int(answer[0].split()[1])
        return True

    def _bring_up(self, index: int, serve: bool = True) -> None:
        """Starts process ``index`` until one is ready (or the server stops); ``serve``: then lets it serve."""
        while not self._stopping.is_set():
            if self._spawn(index) and (not serve or self._serve(index)):
                return
            self._stopping.wait(0.5)

    def _serve(self, index: int) -> bool:
        """Process ``index`` says SERVING on its health service (once every process is up).

        One that can't be told is killed (never two live owners of the same shards): it starts again.
        """
        endpoints = self.endpoints()  # what its GetPlacement answers
        try:
            self._hosts[index].Serve(host_pb.ServeRequest(endpoints=endpoints), timeout=30, wait_for_ready=True)
            told = True
        except grpc.RpcError:
            told = False
        with self._lock:
            process = self._processes[index]
            if told and process is not None and process.poll() is None:
                self._served[index] = True
                others = [i for i in range(self.count) if i != index and self._served[i]]
            else:
                others = None
        if others is not None:
            if endpoints != self._told:  # it came back on another port: the others answer GetPlacement too
                for other in others:
                    with contextlib.suppress(grpc.RpcError):
                        self._hosts[other].Serve(host_pb.ServeRequest(endpoints=endpoints), timeout=5)
                self._told = endpoints
            return True
        if process is not None:
            with contextlib.suppress(OSError):
                process.kill()
            process.wait()
        with self._lock:
            self.restarts[index] += 1  # it starts again
        return False

    def start(self) -> None:
        """Starts every shard process and returns once each serves (one that dies meanwhile starts again); from
        then on one that exits is started again."""
        while not self._stopping.is_set():
            down = [i for i in range(self.count) if not self._served[i]]
            if not down:
                break
            threads = [threading.Thread(target=self._bring_up, args=(i, False), name="clipd-shard-start", daemon=True)
                       for i in down]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            for index in down:  # every one is up: they serve (one that died meanwhile starts again above)
                self._serve(index)
        self._watcher.start()

    def _watch(self) -> None:
        """Restarts a shard process that exits (on a thread of its own: the others go on serving)."""
        while not self._stopping.wait(0.2):
            for index in range(self.count):
                with self._lock:
                    process = self._processes[index]
                    dead = self._served[index] and process is not None and process.poll() is not None
                    if dead:
                        self._served[index] = False
                        self.restarts[index] += 1
                if dead and process is not None and not self._stopping.is_set():
                    log.warning("shard process %d (pid %d) exited with %s; starting another", index, process.pid,
                                process.returncode, extra={"event": "shard_process.restarted"})
                    threading.Thread(target=self._bring_up, args=(index,), name="clipd-shard-start",
                                     daemon=True).start()

    def call(self, index: int, name: str, request, timeout: float):
        """One of the control's calls to process ``index`` over its unix socket (:class:`HostLauncher`)."""
        try:
            return getattr(self._hosts[index], name)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise host_error(f"shard process {index}", e.code(), e.details()) from None

    def reach_control_at(self, host: str, port: int) -> None:
        """(They reach the control on its unix socket, ``control_address``.)"""

    def endpoints(self) -> list[str]:
        host = self.settings.advertise_host or self.settings.host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return [f"{host}:{port}" if port else "" for port in self.data_ports]  # (0: starting, not known yet)

    def processes(self) -> list[dict]:
        with self._lock:
            return [{"index": i, "pid": p.pid if p else None, "alive": bool(p and p.poll() is None),
                     "serving": self._served[i], "restarts": self.restarts[i], "endpoint": e}
                    for i, (p, e) in enumerate(zip(self._processes, self.endpoints()))]

    @property
    def ready(self) -> bool:
        with self._lock:
            return all(self._served)

    def stop(self, timeout: float) -> None:
        """SIGTERM to every shard process (each stops its ports with ``timeout`` grace and commits), then SIGKILL
        to any still running 2 s past it; the private sockets' folder goes."""
        grace = timeout
        self._stopping.set()
        with self._lock:
            processes = [p for p in self._processes if p is not None]
        for process in processes:
            if process.poll() is None:
                process.terminate()  # SIGTERM: it stops its gRPC ports with ``grace``, commits, exits
        deadline = time.monotonic() + grace + 2.0
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for channel in self._channels:
            channel.close()
        shutil.rmtree(self.private_dir, ignore_errors=True)
