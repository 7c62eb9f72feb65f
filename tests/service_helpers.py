"""Helpers for the service tests: reference results computed in-process, a faulty TCP proxy, a server process."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable

import grpc
import jax.numpy as jnp
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import wait_until

from clipd import engine

LAYERS = {"w": (6, 4), "b": (4,), "v": (3, 2, 2)}


def make_updates(n: int, seed: int = 0, layers=LAYERS, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.uniform(-2, 2, n))
    return {
        name: (rng.standard_normal((n, *shape)) * scale.reshape((-1,) + (1,) * len(shape))).astype(dtype)
        for name, shape in layers.items()
    }


def reference(updates: dict[str, np.ndarray], policy: str = "global", clip: float = 1.0,
              layer_clips=None) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Sums and clip counts from the engine's reference APIs, in-process."""
    names = list(updates)
    grads = [jnp.asarray(updates[n]) for n in names]
    if policy == "global":
        sums, count = engine.per_example_global_norm_clip(grads, clip)
        counts = [count] * len(names)
    elif policy == "per_layer_explicit":
        pairs = [engine.per_example_global_norm_clip([g], c) for g, c in zip(grads, layer_clips)]
        sums, counts = [p[0][0] for p in pairs], [p[1] for p in pairs]
    else:
        sums, counts = engine.per_example_layer_norm_clip(grads, clip, uniform=policy == "per_layer_uniform")
    return ({n: np.asarray(s) for n, s in zip(names, sums)}, {n: int(c) for n, c in zip(names, counts)})


def assert_result_matches(result, updates, policy="global", clip=1.0, layer_clips=None, rtol=1e-5):
    ref_sums, ref_counts = reference(updates, policy, clip, layer_clips)
    assert result.examples == len(next(iter(updates.values())))
    assert result.clip_counts == ref_counts
    for name, ref in ref_sums.items():
        np.testing.assert_allclose(result.sums[name], ref, rtol=rtol, atol=rtol * np.abs(ref).max())


class FaultyProxy:
    """A loopback TCP proxy that cuts its first ``faults`` connections after a random number of bytes.

    Bounded: it serves until ``close()``, and each cut happens after at most
    ``max_bytes`` bytes from client to server.
    """

    def __init__(self, upstream_port: int, faults: int, min_bytes: int, max_bytes: int, seed: int = 0,
                 cut_when: Callable[[], bool] | None = None,
                 cut_answer_when: Callable[[], bool] | None = None) -> None:
        self.upstream_port = upstream_port
        # Once a cut's bytes are through, the cut waits (up to 30 s) until ``cut_when()`` holds: a test that needs the
        # server to have *read* some of them (not only its socket to hold them) says so here.
        self.cut_when = cut_when
        # A faulty connection is also cut at the first bytes from the server that arrive once ``cut_answer_when()``
        # holds (they are not forwarded): an answer lost after the server did the work.
        self.cut_answer_when = cut_answer_when
        self.faults_left = faults
        self.cuts = 0
        self.forwarded = 0  # bytes from clients to the server, over every connection
        self.connection_bytes: list[int] = []  # the same, per connection, in the order they were accepted
        self._rng = random.Random(seed)
        self.min_bytes, self.max_bytes = min_bytes, max_bytes
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                downstream, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                cut_after = None
                if self.faults_left > 0:
                    self.faults_left -= 1
                    cut_after = self._rng.randint(self.min_bytes, self.max_bytes)
            with self._lock:
                index = len(self.connection_bytes)
                self.connection_bytes.append(0)
            threading.Thread(target=self._pump, args=(downstream, upstream, cut_after, index), daemon=True).start()
            answer_cut = self.cut_answer_when if cut_after is not None else None
            threading.Thread(target=self._pump, args=(upstream, downstream, None, None, answer_cut),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, cut_after: int | None, upstream: int | None = None,
              cut_if: Callable[[], bool] | None = None) -> None:
        """Copies ``src`` to ``dst``; ``upstream``: the index of a client-to-server direction (bytes counted);
        ``cut_if``: cut (forwarding nothing more) at the first bytes that arrive while it holds."""
        sent = 0
        try:
            while not self._closed.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if cut_if is not None and cut_if():
                    with self._lock:
                        self.cuts += 1
                    break
                if cut_after is not None and sent + len(data) >= cut_after:
                    dst.sendall(data[: cut_after - sent])
                    deadline = time.monotonic() + 30
                    while self.cut_when is not None and not self.cut_when() and time.monotonic() < deadline:
                        time.sleep(0.005)
                    with self._lock:
                        self.cuts += 1
                        self.forwarded += cut_after - sent
                        self.connection_bytes[upstream] += cut_after - sent
                    break
                dst.sendall(data)
                sent += len(data)
                if upstream is not None:
                    with self._lock:
                        self.forwarded += len(data)
                        self.connection_bytes[upstream] += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self._thread.join(timeout=2)


# Channel options for waiting on a server that is starting: reconnect attempts every 50-100 ms. gRPC's default
# backoff (1 s, then x1.6 per refused attempt) noticed a server up to 1-2.5 s after it began to serve.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 100)]


def wait_answering(target: str, alive: Callable[[], None], timeout: float, what: str) -> None:
    """Waits until the gRPC server at ``target`` answers an RPC (the health check, whatever its status: it has
    started). ``alive()`` runs before each try and raises if the server's process is gone.

    (A ``grpc.channel_ready_future`` noticed the same up to 0.5 s later: closing its channel waits for the
    future's polling thread.)"""
    with grpc.insecure_channel(target, options=FAST_RECONNECT) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check

        def answering() -> bool:
            alive()
            try:
                check(health_pb2.HealthCheckRequest(), timeout=0.5, wait_for_ready=True)
                return True
            except grpc.RpcError:
                return False

        wait_until(answering, timeout, what, step=0)


def wait_serving(target: str, timeout: float = 90.0) -> None:
    """Waits until the health check at ``target`` says SERVING (with shard processes: every one of them is up and
    the control has told them where the others are)."""
    with grpc.insecure_channel(target, options=FAST_RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError:
                return False
            return status == health_pb2.HealthCheckResponse.SERVING

        wait_until(serving, timeout, f"{target} SERVING", step=0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``clipd serve`` in a subprocess on a fixed port and data directory; restartable.

    ``args``: more flags for ``clipd serve``; ``env``: more environment (``XLA_FLAGS`` for forced devices).
    """

    def __init__(self, data_dir, cache_dir, port: int, args: tuple[str, ...] = ("--admin-port", "-1"),
                 env: dict[str, str] | None = None) -> None:
        self.data_dir, self.cache_dir, self.port = data_dir, cache_dir, port
        self.args, self.env = tuple(args), dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.kills = 0

    def start(self) -> None:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **self.env}
        # stderr goes to a file: a pipe nobody reads would block the server once 64 KiB of logs are in it.
        self.log_path = pathlib.Path(str(self.data_dir) + ".log")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "clipd", "serve", "--host", "127.0.0.1", "--grpc-port", str(self.port),
                 "--data-dir", str(self.data_dir), "--compilation-cache-dir", str(self.cache_dir), *self.args],
                env=env, stdout=subprocess.DEVNULL, stderr=log,
            )

        def alive() -> None:
            assert self.proc.poll() is None, f"clipd serve exited: {self.log()[-3000:]}"

        wait_answering(f"127.0.0.1:{self.port}", alive, 90, "clipd serve started")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.kills += 1

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def like_test_settings(root: pathlib.Path, cache_dir: str | None = None) -> ServerProcess:
    """A ``clipd serve`` process (not started) with the limits of conftest's TEST_SETTINGS, a durable store under
    ``root`` and JAX's compilation cache in ``cache_dir`` (default: under ``root``), on a free port."""
    from conftest import TEST_SETTINGS

    return ServerProcess(root / "data", cache_dir or root / "jax-cache", free_port(), args=(
        "--admin-port", "-1", "--max-device-rows", str(TEST_SETTINGS["max_device_rows"]),
        "--max-message-bytes", str(TEST_SETTINGS["max_message_bytes"]),
        "--max-aggregations", str(TEST_SETTINGS["max_aggregations"])))


def random_batch(client: str, index: int, layers: dict[str, tuple[int, ...]], rows: int) -> dict[str, np.ndarray]:
    """Batch ``index`` of ``client``: float32, deterministic, example norms spread around 1 (about half clipped at 1)."""
    rng = np.random.default_rng([zlib.crc32(client.encode()), index])
    size = sum(int(np.prod(shape)) for shape in layers.values())
    scale = np.exp(rng.uniform(-1.5, 1.5, rows)) / np.sqrt(size)
    return {name: (rng.standard_normal((rows, *shape)) * scale.reshape((-1,) + (1,) * len(shape))).astype(np.float32)
            for name, shape in layers.items()}


def global_clip_reference(batches, clip: float) -> tuple[dict[str, np.ndarray], int, int]:
    """Global-L2 clipped sums in float64 numpy (sum of min(1, C / ||x||) * x), the clipped and the example counts."""
    sums: dict[str, np.ndarray] = {}
    clipped = examples = 0
    for batch in batches:
        rows = len(next(iter(batch.values())))
        x = {name: values.astype(np.float64).reshape(rows, -1) for name, values in batch.items()}
        norms = np.sqrt(sum((v**2).sum(axis=1) for v in x.values()))
        factor = np.minimum(1.0, clip / norms)
        clipped += int((norms > clip).sum())
        examples += rows
        for name, values in batch.items():
            sums[name] = sums.get(name, 0.0) + (factor @ x[name]).reshape(values.shape[1:])
    return sums, clipped, examples


def get_json(url: str, wait: float = 30.0) -> dict:
    """GET ``url`` as JSON, waiting up to ``wait`` s for the server to answer (the admin API starts after gRPC)."""
    errors: list[urllib.error.URLError] = []

    def answer() -> tuple | None:  # the JSON in a tuple: an empty object is an answer too
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                return (json.load(response),)
        except urllib.error.URLError as e:
            errors.append(e)
            return None

    return wait_until(answer, wait, lambda: f"an answer from {url} (last: {errors[-1]!r})", step=0.1)[0]


@contextlib.contextmanager
def submitting(target: str, aggregation: str, clients, updates, examples: int, **client_options):
    """Each of ``clients`` submits ``updates(client)`` in a thread of its own while the block runs (faults go there).

    When the block ends, every submission must have returned with ``examples`` acknowledged examples.
    """
    from clipd.client import Client

    errors: list[Exception] = []

    def run(client: str) -> None:
        try:
            with Client(target, **client_options) as c:
                report = c.submit(aggregation, updates(client), client_id=client)
            assert report.examples == examples, (client, report)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(client,)) for client in clients]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors


def assert_exact_global_clip(result, clients, batches, rows: int, layers: dict, clip: float) -> None:
    """``result`` holds exactly ``random_batch(c, i, layers, rows)`` of every client ``c`` and batch ``i``, clipped
    globally at ``clip``: the float64 numpy reference's sums, examples and clip counts."""
    sums, clipped, examples = global_clip_reference(
        [random_batch(c, i, layers, rows) for c in clients for i in batches], clip)
    assert result.examples == examples == len(clients) * len(batches) * rows
    assert result.clip_counts == {name: clipped for name in layers}
    for name in layers:
        np.testing.assert_allclose(result.sums[name], sums[name], rtol=1e-5, atol=1e-5 * np.abs(sums[name]).max())
