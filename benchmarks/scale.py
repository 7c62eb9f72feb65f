"""Scale benchmark: throughput and CPU per GB with one process and with N shard processes.

What runs, for each mode (all on loopback, one mode at a time, the same payloads):

  loopback TCP  the reference: the same bytes through a plain TCP socket on loopback
                (client processes ``sendall``, one receiving process ``recv_into``), i.e.
                what the machine moves with no protocol at all (``--iperf3`` where installed).
  bare gRPC N   the gRPC reference: N sink processes on one port (SO_REUSEPORT), each a
                grpcio server whose Submit parses every message with clipd's parser and
                keeps nothing; the same messages from the same number of client processes.
  one process   ``clipd serve`` (``--processes 0``): the one process receives, parses and sums.
  N shards      ``clipd serve --processes N``: N shard processes receive, parse, clip and sum
                (each its own shards); the control process only creates, finalizes, merges.

Each clipd mode: a fresh ``clipd serve`` subprocess with a durable store (SQLite in a
temporary directory), one aggregation of 262,144 float32 parameters in 4 layers (1 MiB an
example), warmed up; then ``--clients`` client *processes* (their CPU is not the
server's), each submitting ``--examples`` examples with the Python client (routed: each
stream straight to its shard's process), all at once. The clock runs from the moment
every client process is ready until the last one has its last acknowledgement. CPU-seconds
are user+system time (``/proc/<pid>/stat``) of the control process and of the shard
processes over that window.

Columns: GB/s (payload bytes / wall seconds; 1 GB = 1e9 bytes), CPU-s per GB of the whole
process tree, of the control process alone, the largest share of one process in the tree's
CPU, and GB/s against the bare gRPC sink with as many processes. Every mode runs
``--repeats`` times (3) interleaved (mode order reversed every other repeat); the table
shows medians. The last line is::

    dataplane: control_cpu_per_gb=<x> cpu_per_gb_ratio_2v1=<y> max_process_share_2=<z>

with 2 shard processes: the control process's CPU-s per GB, the tree's CPU per GB over one
process's (``--processes 0``), and the largest share of one process in the tree's CPU.

    python benchmarks/scale.py                              # 0, 1, 2 processes, 4 clients
    python benchmarks/scale.py --processes 0 1 2 4 8 --clients 8   # a bigger machine
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import queue
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
        done.put("ready")
        start.wait()
        report = client.submit(aggregation, updates, client_id=f"bench-{seed}")
    assert report.examples == examples, report
    done.put(time.monotonic())


def _bare_messages(seed: int, examples: int, per_message: int = 2) -> list[bytes]:
    """The serialized SubmitRequests of ``examples`` examples, 2 (2 MiB) a message, as the client packs them."""
    from clipd import wire

    updates, messages = _updates(seed, examples), []
    for sequence, start in enumerate(range(0, examples, per_message), 1):
        parts = [array[start : start + per_message] for array in updates.values()]
        messages += wire.submit_batch("bare", f"bench-{seed}", sequence, parts, 1 << 30, "w")
    return messages


def _bare_client(target: str, seed: int, examples: int, start, done) -> None:
    import grpc

    messages = _bare_messages(seed, examples)
    limit = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20)]
    with grpc.insecure_channel(target, limit) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        submit = channel.stream_stream("/clipd.v1.Clipd/Submit")
        done.put("ready")
        start.wait()
        assert list(submit(iter(messages), timeout=600)) == [b"done"]
    done.put(time.monotonic())


def bare_sink(port: int) -> None:
    """``python benchmarks/scale.py --bare-sink PORT``: one sink process (parses every message, keeps nothing)."""
    from clipd import wire

    def submit(requests, context):
        for raw in requests:
            wire.parse_submit_request(raw)
        yield b"done"

    serve_sync_sink(port, submit, 64, [("grpc.so_reuseport", 1), ("grpc.max_receive_message_length", 16 << 20)])


def serve_sync_sink(port: int, submit, threads: int, options) -> None:
    """A plain sync ``grpc.server`` on ``127.0.0.1:port`` with ``submit`` (raw bytes in and out) as Clipd's
    Submit; says "ready" on stdout once it listens, then serves until killed (also ``benchmarks/round.py``'s)."""
    import concurrent.futures

    import grpc

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(threads), options=options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "clipd.v1.Clipd", {"Submit": grpc.stream_stream_rpc_method_handler(submit)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def measure_bare(processes: int, clients: int, examples: int, seed: int) -> tuple[float, float, float, float]:
    """(wall s, tree CPU s, 0, largest process share) of the bare gRPC sink with ``processes`` processes."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    sinks = [subprocess.Popen([sys.executable, __file__, "--bare-sink", str(port)], stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    try:
        for sink in sinks:
            assert sink.stdout.readline() == "ready\n"
        pids = [p.pid for p in sinks]
        cpu0 = [_cpu_seconds([pid]) for pid in pids]
        wall = _run_clients(ctx, _bare_client, clients, lambda i: (f"127.0.0.1:{port}", seed * 1000 + i, examples))
        cpu = [_cpu_seconds([pid]) - c for pid, c in zip(pids, cpu0)]
        return wall, sum(cpu), 0.0, max(cpu) / max(sum(cpu), 1e-9)
    finally:
        for sink in sinks:
            sink.kill()
            sink.wait()


def _tcp_client(port: int, nbytes: int, start, done) -> None:
    payload = np.random.default_rng(0).bytes(1 << 22)
    with socket.create_connection(("127.0.0.1", port)) as s:
        done.put("ready")
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
    ready = 0
    while ready < clients:  # every client has made its payload and connected (they wait on ``start``)
        try:
            ready += done.get(timeout=1.0) == "ready"
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a client process failed before the start") from None
    time.sleep(0.1)  # the last one reaches ``start.wait()``
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
             str(self.admin_port), "--data-dir", os.path.join(workdir, f"data-{self.port}"), "--processes", str(processes),
             "--compilation-cache-dir", os.path.join(workdir, "jax-cache"), "--log-level", "warning",
             "--no-warm-privacy"],  # (no private release here: the privacy accountant is not loaded)
            env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")},
            stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # "clipd serving gRPC on ..." once listening
        if "serving" not in line:
            raise RuntimeError(f"clipd serve did not start: {line!r}")
        self.target = f"127.0.0.1:{self.port}"
        self.pids = [self.proc.pid] + [p["pid"] for p in self.server_view()["shard_processes"]]

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
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (clipd serve stops gracefully), then SIGKILL if it is still there after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def measure_clipd(processes: int, clients: int, examples: int, workdir: str, seed: int
                  ) -> tuple[float, float, float, float]:
    """(wall s, tree CPU s, control CPU s, largest process share) of ``clients`` x ``examples`` examples."""
    from clipd.client import Client

    ctx = multiprocessing.get_context("spawn")
    server = Server(processes, workdir)
    try:
        with Client(server.target) as c:
            aggregation = c.create_aggregation(LAYERS, l2_norm_clip=1.0)
            c.submit(aggregation, _updates(999, 8), client_id="warm-up")  # waits for the warm-up
        cpu0 = [_cpu_seconds([pid]) for pid in server.pids]
        wall = _run_clients(ctx, _client, clients,
                            lambda i: (server.target, aggregation, seed * 1000 + i, examples))
        cpu = [_cpu_seconds([pid]) - c for pid, c in zip(server.pids, cpu0)]
        print(f"      control process {cpu[0]:.2f} CPU-s, shard processes {' '.join(f'{c:.2f}' for c in cpu[1:])}",
              flush=True)
        with Client(server.target) as c:
            result = c.finalize(aggregation)
        assert result.examples == clients * examples + 8, result.examples
        return wall, sum(cpu), cpu[0], max(cpu) / max(sum(cpu), 1e-9)
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
                        help="modes: 0 = one process, N = N shard processes (must include 0 and 2)")
    parser.add_argument("--clients", type=int, default=4, help="client processes at once")
    parser.add_argument("--examples", type=int, default=192, help="examples (1 MiB each) per client")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iperf3", action="store_true", help="loopback reference by iperf3 (where installed)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 clients x 16 examples, 1 repeat")
    parser.add_argument("--bare-sink", type=int, help=argparse.SUPPRESS)  # one bare gRPC sink process
    args = parser.parse_args()
    if args.bare_sink:
        return bare_sink(args.bare_sink)
    if args.quick:
        args.clients, args.examples, args.repeats = 2, 16, 1
    if not {0, 2} <= set(args.processes):
        parser.error("--processes must include 0 and 2 (the closing line)")
    payload = args.clients * args.examples * EXAMPLE_BYTES
    print(f"scale benchmark: {args.clients} client processes x {args.examples} examples of {EXAMPLE_BYTES:,} B"
          f" = {payload / 1e9:.3f} GB per run; {args.repeats} repeats, medians; durable store (SQLite)")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")

    workdir = tempfile.mkdtemp(prefix="clipd-scale-")
    runs: dict[str, list[tuple[float, float, float, float]]] = {}
    modes = [("tcp", None)] + [(f"bare{max(n, 1)}", n) for n in sorted({max(n, 1) for n in args.processes})] \
        + [(f"p{n}", n) for n in args.processes]
    try:
        for repeat in range(args.repeats):
            for name, processes in (modes if repeat % 2 == 0 else modes[::-1]):
                if processes is None:
                    use_iperf = args.iperf3 and shutil.which("iperf3")
                    wall, cpu = (measure_iperf3 if use_iperf else measure_tcp)(args.clients,
                                                                                args.examples * EXAMPLE_BYTES)
                    run = (wall, cpu, 0.0, 1.0)
                elif name.startswith("bare"):
                    run = measure_bare(processes, args.clients, args.examples, repeat)
                else:
                    run = measure_clipd(processes, args.clients, args.examples, workdir, repeat)
                runs.setdefault(name, []).append(run)
                print(f"  repeat {repeat + 1}: {name:>6}: {run[0]:.3f} s, {run[1]:.2f} CPU-s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    gb = payload / 1e9
    table = {}
    for name, results in runs.items():
        table[name] = (statistics.median(r[0] for r in results), gb / statistics.median(r[0] for r in results),
                       statistics.median(r[1] / gb for r in results), statistics.median(r[2] / gb for r in results),
                       statistics.median(r[3] for r in results))
    print()
    print(f"{'mode':<26}| {'wall s':>7} | {'GB/s':>6} | {'CPU-s/GB':>8} | {'control CPU-s/GB':>16} |"
          f" {'max share':>9} | {'vs bare gRPC':>12}")
    print("-" * 104)
    label = {"tcp": "loopback TCP (reference)" + (" iperf3" if args.iperf3 and shutil.which("iperf3") else ""),
             "p0": "one process"}
    for name, processes in modes:
        wall, rate, cpu, control, share = table[name]
        if name.startswith("bare"):
            text = f"bare gRPC, {processes} process{'es' if processes > 1 else ''}"
        else:
            text = label.get(name, f"{name[1:]} shard process{'es' if name != 'p1' else ''}")
        bare = table.get(f"bare{max(processes or 1, 1)}") if name.startswith("p") else None
        ratio = f"{rate / bare[1]:12.3f}" if bare else " " * 12
        print(f"{text:<26}| {wall:7.3f} | {rate:6.3f} | {cpu:8.2f} | {control:16.3f} | {share:9.2f} | {ratio}")
    print()
    for name, _ in modes:
        if name.startswith("p") and name != "p0":
            print(f"throughput_ratio_{name[1:]}v0={table[name][1] / table['p0'][1]:.3f}")
    print(f"dataplane: control_cpu_per_gb={table['p2'][3]:.3f} cpu_per_gb_ratio_2v1={table['p2'][2] / table['p0'][2]:.3f}"
          f" max_process_share_2={table['p2'][4]:.3f}")


if __name__ == "__main__":
    main()
