"""Abuse of a real ``clipd serve`` process: memory held by abandoned streams, malformed floods, SIGTERM.

The server runs in a subprocess so its resident memory and its exit are its own.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from helpers import wait_until
from service_helpers import wait_answering

from clipd.client import Client
from clipd.v1 import clipd_pb2 as pb

SUBMIT = "/clipd.v1.Clipd/Submit"
MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """``clipd serve`` on loopback, its log in a file; ``processes``: that many shard processes (they receive the
    batches: :meth:`rss` is theirs), with a durable store (they share one)."""

    def __init__(self, tmp_path: pathlib.Path, processes: int = 0, **env: str) -> None:
        self.port = _free_port()
        self.processes = processes
        self.log_path = tmp_path / "serve.log"
        self.log = open(self.log_path, "wb")
        environ = {**os.environ, "JAX_PLATFORMS": "cpu", **{f"CLIPD_{k.upper()}": v for k, v in env.items()}}
        data_dir = str(tmp_path / "data") if processes else "memory"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clipd", "serve", "--host", "127.0.0.1", "--grpc-port", str(self.port),
             "--admin-port", "-1", "--data-dir", data_dir, "--processes", str(processes)],
            env=environ, stdout=self.log, stderr=subprocess.STDOUT)

        def alive() -> None:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]

        wait_answering(self.target, alive, 60, "clipd serve started")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def rss(self) -> int:
        """Resident bytes (VmRSS) of the server process, or of its shard processes together."""
        pids = [self.proc.pid]
        if self.processes:
            pids = [int(p) for task in pathlib.Path(f"/proc/{self.proc.pid}/task").iterdir()  # (each thread's:
                    for p in (task / "children").read_text().split()]  # another thread started them)
            assert len(pids) == self.processes, pids
        return sum(_vm_rss(pid) for pid in pids)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


def _vm_rss(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture()
def serve(tmp_path):
    started = []

    def start(**env):
        started.append(Serve(tmp_path, **env))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _stall(channel, messages: list[bytes], release: threading.Event, codes: list, greeted: list) -> grpc.Future:
    def requests():
        yield from messages
        release.wait()

    call = channel.stream_stream(SUBMIT, request_serializer=None, response_deserializer=None)(requests())

    def drain():  # gRPC surfaces the status only after the answers are read
        try:
            for k, _ in enumerate(call):
                if k == 0:
                    greeted.append(call)  # the server answered the hello: the stream is open there
        except grpc.RpcError:
            pass
        codes.append(call.code())

    threading.Thread(target=drain, daemon=True).start()
    return call


def _half_batches(serve: Serve, aggregation: str, streams: int,
                  batch_bytes: int) -> tuple[list, threading.Event, list, list]:
    """``streams`` streams each sending the first half of a ``batch_bytes`` batch, then stalling.

    Returns the calls, the event that ends their requests, their status codes once ended, and the calls the
    server has answered the hello of (open on the server).
    """
    width = batch_bytes // 4
    channel = grpc.insecure_channel(serve.target, options=[("grpc.max_send_message_length", 64 * MiB)])
    release, codes, greeted, calls = threading.Event(), [], [], []
    half = np.ones(width // 2, np.float32).tobytes()
    for k in range(streams):
        client = f"abandon-{k}"
        chunk = pb.TensorChunk(layer=0, dtype=pb.FLOAT32, shape=[1, width], offset=0, data=half)
        calls.append(_stall(channel, [
            pb.SubmitRequest(aggregation_id=aggregation, client_id=client, writer_id=client).SerializeToString(),
            pb.SubmitRequest(aggregation_id=aggregation, client_id=client, sequence=1,
                             chunks=[chunk]).SerializeToString(),
        ], release, codes, greeted))
    return calls, release, codes, greeted


def _rss_below(serve: Serve, limit: int, timeout: float, what: str, steady: float = 0.0) -> int:
    """Polls the server's RSS until it is under ``limit`` bytes (and, with ``steady``, has moved less than 8 MiB
    over the last ``steady`` s), and returns it; fails if it still is not after ``timeout`` s."""
    seen: list[tuple[float, int]] = []

    def below() -> bool:
        now = time.monotonic()
        seen.append((now, serve.rss()))
        window = [rss for at, rss in seen if at >= now - steady]
        return seen[-1][1] < limit and seen[0][0] <= now - steady and max(window) - min(window) < 8 * MiB

    wait_until(below, timeout, lambda: f"{what}: RSS {seen[-1][1] // MiB} MiB, not under {limit // MiB} MiB"
                                       f"{f' and steady for {steady} s' if steady else ''}", step=0.1)
    return seen[-1][1]


@pytest.mark.parametrize("processes", [0, 1], ids=["one process", "a shard process"])
def test_memory_of_abandoned_half_batches_is_released(serve, processes):
    """100 streams each leave 8 MiB (half of a 16 MiB batch) and are cut: RSS comes back to the baseline once
    the time a resuming stream may take them up (stream_idle_timeout, 2 s here) has passed; in ``clipd serve``,
    and in a shard process (whose heap is its own: it trims it too).

    RSS is polled, not read after fixed waits: the first round (one-time allocations) ends once what it held is
    given back and RSS has stayed put for a second (the baseline); the second passes as soon as RSS is within
    64 MiB of that baseline, and fails if it is not within the 5 s that the fixed wait gave it."""
    server = serve(processes=processes, max_buffered_bytes=str(2048 * MiB), max_message_bytes=str(32 * MiB),
                   stream_idle_timeout="2", buffer_wait="1")
    with Client(server.target) as client:
        aggregation = client.create_aggregation({"w": (4 * MiB,)})  # 16 MiB per example
        rounds = []
        before = server.rss()
        for round_ in range(2):  # the first round also pays one-time allocations: the baseline is after it
            calls, release, codes, _ = _half_batches(server, aggregation, 100, 16 * MiB)
            deadline = time.monotonic() + 60
            while client.stats(aggregation).state and time.monotonic() < deadline:
                held = server.rss()
                if held > before + 700 * MiB:
                    break
                time.sleep(0.2)
            peak = server.rss()
            for call in calls:
                call.cancel()  # the clients vanish mid-batch
            release.set()
            # The idle timeout (kept for a resume), then freed.
            if round_ == 0:  # most of what was held given back, and steady: the second round's baseline
                rounds.append((before, peak, _rss_below(server, peak - 600 * MiB, 30, "warm-up round", steady=1.0)))
                before = rounds[-1][-1]
            else:
                rounds.append((before, peak, _rss_below(server, before + 64 * MiB, 5.0, "half batches released")))
        print("\nRSS MiB (before, holding 100 x 8 MiB, after):", [tuple(x // MiB for x in r) for r in rounds])
        before, peak, after = rounds[-1]
        assert peak > before + 700 * MiB  # the half batches were really held...
        assert after < before + 64 * MiB  # ...and given back when their streams ended
        # The aggregation took nothing from them and still works.
        client.submit(aggregation, {"w": np.ones((1, 4 * MiB), np.float32)})
        assert client.finalize(aggregation).examples == 1


def test_malformed_messages_are_invalid_argument_with_one_log_line_and_sigterm_still_stops(serve):
    server = serve(shutdown_grace="1")  # (1 s: the five held streams keep it that long; it was 2 s)
    channel = grpc.insecure_channel(server.target)
    submit = channel.stream_stream(SUBMIT, request_serializer=None, response_deserializer=None)
    create = channel.unary_unary("/clipd.v1.Clipd/CreateAggregation", request_serializer=None,
                                 response_deserializer=None)
    garbage = [b"\xff" * 11, b"\x0a\x05ab", b"\x22\x03\x08\x80", b"\x07", b"\x1a\x02\xc3\x28"]
    for k in range(50):
        with pytest.raises(grpc.RpcError) as e:
            list(submit(iter([garbage[k % len(garbage)]]), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "malformed SubmitRequest" in e.value.details()
    for k in range(10):
        with pytest.raises(grpc.RpcError) as e:
            create(garbage[k % len(garbage)], timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in e.value.details()

    with Client(server.target) as client:  # the server is fine
        aggregation = client.create_aggregation({"w": (16 * 1024,)})
        held, release, codes, greeted = _half_batches(server, aggregation, 5, 64 * 1024)  # open at SIGTERM
        wait_until(lambda: len(greeted) == 5, 10, "the five streams open on the server")
        assert not codes  # the five are held open
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=1 + 5 + 5)
        took = time.monotonic() - started
        release.set()
    print(f"\nSIGTERM with 5 open streams after 60 malformed requests: exited {code} in {took:.2f} s (grace 1 s)")
    assert code == 0 and took < 1 + 5
    assert len(codes) == 5  # cut when the grace period ran out
    log = server.log_path.read_text()
    assert "Traceback" not in log
    assert sum("malformed" in line for line in log.splitlines()) == 60  # one line per refusal
