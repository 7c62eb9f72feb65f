"""Scale benchmark: ingest throughput and server CPU per GB with 0, 1, 2, ... ingest processes.

What runs, for each mode (all on loopback, one mode at a time, the same payloads):

  one process   ``clipd serve`` (``--processes 0``): the one process receives, parses and sums;
  N ingest      ``clipd serve --processes N``: N ingest processes on the port receive and parse,
                and forward through shared memory to the server process, which sums.
  loopback TCP  the reference: the same bytes through a plain TCP socket on loopback
                (client processes ``sendall``, one receiving process ``recv_into``), i.e.
                what the machine moves with no protocol at all. ``iperf3`` is used instead
                where it is installed (``--iperf3``).

Each mode: a fresh ``clipd serve`` subprocess (``--data-dir memory``: no disk, so
the figures are the ingest path's, not fsync's), one aggregation of 262,144
float32 parameters in 4 layers (1 MiB an example), warmed up; then ``--clients``
client *processes* (their CPU is not the server's) each submit ``--examples``
examples under their own client id, all at once. The clock runs from the moment
every client process is ready until the last one has its acknowledgement for
its last batch. Server CPU-seconds are the user+system time of the server
process and its ingest processes (``/proc/<pid>/stat``) over that window.

Columns: GB/s (payload bytes / wall seconds; 1 GB = 1e9 bytes), server CPU-s per
GB, and the ratio of each mode's CPU per GB to that of 1 ingest process. Every
mode runs ``--repeats`` times (5) interleaved (mode order reversed every other
repeat); the table shows medians. The last line is
``ingest_cpu_per_gb_ratio_2v1=<x>``: CPU per GB with 2 ingest processes over 1.
On 2 cores no speed-up can show (the clients need CPU too); what must hold is
that a second process costs no extra CPU per byte.

    python benchmarks/scale.py                 # 0, 1, 2 processes, 4 clients
    python benchmarks/scale.py --processes 0 1 2 4 8 --clients 16   # a bigger machine
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

LAYERS = {"l0": (256, 256), "l1": (256, 256), "l2": (256, 256), "l3": (256, 256)}  # 262,144 params: 1 MiB
EXAMPLE_BYTES = 4 * sum(int(np.prod(s)) for s in LAYERS.values())
TICKS = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds so far of the processes ``pids``."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / TICKS


def _updates(seed: int, examples: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((examples, *shape), dtype=np.float32) / 512 for name, shape in LAYERS.items()}


# Client processes --------------------------------------------------------------------------
def _client(target: str, aggregation: str, seed: int, examples: int, start, done) -> None:
    from clipd.client import Client

    updates = _updates(seed, examples)  # made before the clock starts
    with Client(target) as client:
        client.layers(aggregation)
        start.wait()
        report = client.submit(aggregation, updates, client_id=f"bench-{seed}")
    assert report.examples == examples, report
    done.put(time.monotonic())


def _tcp_client(port: int, nbytes: int, start, done) -> None:
    payload = np.random.default_rng(0).bytes(1 << 22)
    with socket.create_connection(("127.0.0.1", port)) as s:
        start.wait()
        sent = 0
        while sent < nbytes:
            n = min(len(payload), nbytes - sent)
            s.sendall(payload[:n])
            sent += n
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
    done.put(time.monotonic())


def _tcp_sink(listener: socket.socket, clients: int) -> None:
    buf = bytearray(1 << 22)

    def drain(conn: socket.socket) -> None:
        with conn:
            while conn.recv_into(buf):
                pass
            conn.sendall(b"k")

    threads = []
    for _ in range(clients):
        conn, _ = listener.accept()
        threads.append(threading.Thread(target=drain, args=(conn,)))
        threads[-1].start()
    for t in threads:
        t.join()


def _run_clients(ctx, target, clients: int, make_args) -> float:
    """Starts the client processes, releases them at once, returns the wall seconds until the last is done."""
    start, done = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*make_args(i), start, done)) for i in range(clients)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # every client has made its payload and connected (they wait on ``start``)
    t0 = time.monotonic()
    start.set()
    ends = [done.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"a client process failed (exit {p.exitcode})")
    return max(ends) - t0


# Servers -------------------------------------------------------------------------------------
class Server:
    def __init__(self, processes: int, workdir: str) -> None:
        self.port, self.admin_port = _free_port(), _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clipd", "serve", "--grpc-port", str(self.port), "--admin-port",
             str(self.admin_port), "--data-dir", "memory", "--processes", str(processes),
             "--compilation-cache-dir", os.path.join(workdir, "jax-cache"), "--log-level", "warning"],
            env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")},
            stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # "clipd serving gRPC on ..." once listening
        if "serving" not in line:
            raise RuntimeError(f"clipd serve did not start: {line!r}")
        self.target = f"127.0.0.1:{self.port}"
        self.pids = [self.proc.pid] + [p["pid"] for p in self.server_view()["ingest_processes"]]

    def server_view(self) -> dict:
        url = f"http://127.0.0.1:{self.admin_port}/api/v1/server"
        for _ in range(300):
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    return json.load(response)
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the admin API did not answer")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure_clipd(processes: int, clients: int, examples: int, workdir: str, seed: int) -> tuple[float, float]:
    """(wall seconds, server CPU seconds) of ``clients`` x ``examples`` examples into one aggregation."""
    from clipd.client import Client

    ctx = multiprocessing.get_context("spawn")
    server = Server(processes, workdir)
    try:
        with Client(server.target) as c:
            aggregation = c.create_aggregation(LAYERS, l2_norm_clip=1.0)
            c.submit(aggregation, _updates(999, 8), client_id="warm-up")  # waits for the warm-up
        main0, ingest0 = _cpu_seconds(server.pids[:1]), _cpu_seconds(server.pids[1:])
        wall = _run_clients(ctx, _client, clients,
                            lambda i: (server.target, aggregation, seed * 1000 + i, examples))
        main, ingest = _cpu_seconds(server.pids[:1]) - main0, _cpu_seconds(server.pids[1:]) - ingest0
        print(f"      server process {main:.2f} CPU-s, ingest processes {ingest:.2f}", flush=True)
        cpu = main + ingest
        with Client(server.target) as c:
            result = c.finalize(aggregation)
        assert result.examples == clients * examples + 8, result.examples
        return wall, cpu
    finally:
        server.stop()


def measure_tcp(clients: int, nbytes: int) -> tuple[float, float]:
    """(wall seconds, receiver CPU seconds) of ``clients`` x ``nbytes`` through loopback TCP, or iperf3."""
    ctx = multiprocessing.get_context("spawn")
    listener = socket.create_server(("127.0.0.1", 0), backlog=clients)
    sink = threading.Thread(target=_tcp_sink, args=(listener, clients))
    sink.start()
    usage0 = os.times()
    wall = _run_clients(ctx, _tcp_client, clients, lambda i: (listener.getsockname()[1], nbytes))
    sink.join()
    usage1 = os.times()
    listener.close()
    return wall, (usage1.user - usage0.user) + (usage1.system - usage0.system)


def measure_iperf3(clients: int, nbytes: int) -> tuple[float, float]:
    port = _free_port()
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    try:
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-P", str(clients), "-n",
                              str(clients * nbytes), "-J"], capture_output=True, text=True, check=True)
    finally:
        server.wait(30)
    end = json.loads(out.stdout)["end"]
    seconds = end["sum_received"]["seconds"]
    return seconds, end["cpu_utilization_percent"]["remote_total"] / 100 * seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[0, 1, 2],
                        help="modes: 0 = one process, N = N ingest processes (must include 1 and 2)")
    parser.add_argument("--clients", type=int, default=4, help="client processes at once")
    parser.add_argument("--examples", type=int, default=192, help="examples (1 MiB each) per client")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iperf3", action="store_true", help="loopback reference by iperf3 (where installed)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 clients x 16 examples, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.examples, args.repeats = 2, 16, 1
    if not {1, 2} <= set(args.processes):
        parser.error("--processes must include 1 and 2 (the closing ratio)")
    payload = args.clients * args.examples * EXAMPLE_BYTES
    print(f"scale benchmark: {args.clients} client processes x {args.examples} examples of {EXAMPLE_BYTES:,} B"
          f" = {payload / 1e9:.3f} GB per run; {args.repeats} repeats, medians")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")

    workdir = tempfile.mkdtemp(prefix="clipd-scale-")
    runs: dict[str, list[tuple[float, float]]] = {}
    modes = [("tcp", None)] + [(f"p{n}", n) for n in args.processes]
    try:
        for repeat in range(args.repeats):
            for name, processes in (modes if repeat % 2 == 0 else modes[::-1]):
                if processes is None:
                    use_iperf = args.iperf3 and shutil.which("iperf3")
                    run = (measure_iperf3 if use_iperf else measure_tcp)(args.clients, args.examples * EXAMPLE_BYTES)
                else:
                    run = measure_clipd(processes, args.clients, args.examples, workdir, repeat)
                runs.setdefault(name, []).append(run)
                print(f"  repeat {repeat + 1}: {name:>4}: {run[0]:.3f} s, {run[1]:.2f} CPU-s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    gb = payload / 1e9
    table = {}
    for name, results in runs.items():
        wall = statistics.median(w for w, _ in results)
        cpu_per_gb = statistics.median(c / gb for _, c in results)
        table[name] = (wall, gb / wall, cpu_per_gb)
    base = table["p1"][2]
    print()
    print(f"{'mode':<28}| {'wall s':>7} | {'GB/s':>6} | {'CPU-s/GB':>8} | {'CPU/GB vs 1 ingest':>18}")
    print("-" * 80)
    label = {"tcp": "loopback TCP (reference)" + (" iperf3" if args.iperf3 and shutil.which("iperf3") else ""),
             "p0": "one process"}
    for name, _ in modes:
        wall, rate, cpu = table[name]
        text = label.get(name, f"{name[1:]} ingest process{'es' if name != 'p1' else ''}")
        print(f"{text:<28}| {wall:7.3f} | {rate:6.3f} | {cpu:8.2f} | {cpu / base:18.3f}")
    print()
    for name, _ in modes:
        if name not in ("tcp", "p1"):
            print(f"ingest_throughput_ratio_{name[1:]}v1={table[name][1] / table['p1'][1]:.3f}")
    print(f"ingest_cpu_per_gb_ratio_2v1={table['p2'][2] / base:.3f}")


if __name__ == "__main__":
    main()
