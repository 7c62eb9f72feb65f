"""A cross-device round: thousands of clients, each sending one update at once, summed exactly.

What runs (loopback, ``clipd serve --processes P`` with a durable store, one aggregation of
one float32 layer of 65,536 values = 256 KiB an update, global clipping at 1.0):

  round      ``--clients`` clients (default 2,000), each its own ``Client`` (its own channel
             and connection) and client id, each submitting ONE update, all released at once;
             they run as threads spread over ``--client-processes`` processes (default 8).
  8 clients  the same bytes from 8 clients, each submitting ``clients / 8`` updates as one
             client (the reference: the service's throughput when connections are few).

  --sinks   the same two modes against bare gRPC sinks instead of clipd (``--processes`` processes
             sharing the port by SO_REUSEPORT, each parsing every message with clipd's parser and
             acknowledging it, keeping nothing): the sync server (a thread pool of 256) and
             ``grpc.aio`` (one event loop), with raw streams on a channel per client. This is the
             measurement behind the choice of server for the shard endpoints: what 2,000 connections
             cost the gRPC runtime itself on this machine, before anything clipd does.

Every client must finish without an error (the client's own retries are fine: a full set of
stream slots answers RESOURCE_EXHAUSTED with a retry hint, and the client waits and tries
again); the reconnects are counted. Each run's result is checked against a float64 numpy
reference of the clipped sum. Columns: wall seconds, GB/s of payload, the server's CPU
seconds (``clipd serve`` and its shard processes, or the sinks; from before the clients connect),
the server's CPU from the start to the last acknowledgement per client (ms), clients that saw an
error, reconnects. The last line is::

    round: clients=<n> exact=<True|False> errors=<n> throughput_ratio=<round GB/s over 8 clients'>
           retries_per_client=<reconnects / clients> server_ms_per_client=<server CPU from the start, per client>

and with ``--sinks``::

    sinks: clients=<n> sync_round_ratio=<x> aio_round_ratio=<y> aio_over_sync_round=<z>

Run::

    python benchmarks/round.py                        # 2,000 clients, 2 shard processes
    python benchmarks/round.py --clients 200 --client-processes 2 --repeats 1   # a quick one
    python benchmarks/round.py --sinks                # bare sync vs grpc.aio sinks, same clients
    python benchmarks/round.py --clients 5000 --update-kib 16          # many small updates
    python benchmarks/round.py --clients 1000 --store memory --processes 0    # clipd serve alone, no shards
"""

from __future__ import annotations

import argparse
import contextlib
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

import numpy as np
from scale import stop_process  # benchmarks/scale.py (benchmarks/ is this script's directory)

WIDTH = int(os.environ.get("CLIPD_ROUND_WIDTH", 65_536))  # float32: 256 KiB an update (--update-kib sets it)
CLIP = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _update(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(WIDTH, dtype=np.float32) / 200


def _together(one, items, ready: threading.Barrier, done) -> None:
    """``one(item)`` in a thread per item; "ready" on ``done`` once each waits at ``ready`` (or one failed)."""
    threads = [threading.Thread(target=one, args=(item,)) for item in items]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        ready.wait()
    done.put("ready")  # every client of this process has its update and its channel, and waits for the start
    for t in threads:
        t.join()


def _round_clients(target: str, aggregation: str, seeds: list[int], start, done) -> None:
    """One process of the round: a thread (and a Client) per seed, one update each."""
    from clipd.client import Client

    errors, reconnects = [], []
    ready = threading.Barrier(len(seeds) + 1)

    def one(seed: int) -> None:
        update = _update(seed)
        try:
            with Client(target, retry_timeout=300, retry_delay=0.05) as client:
                client.layers(aggregation)
                ready.wait()
                start.wait()
                report = client.submit(aggregation, {"x": update}, client_id=f"device-{seed}")
                reconnects.append(report.reconnects)
        except threading.BrokenBarrierError:
            errors.append("not started: another client of this process failed before the round")
        except Exception as e:  # counted: a round must have none
            errors.append(f"{e!r}: {getattr(e, 'details', '') or e}")
            ready.abort()

    _together(one, seeds, ready, done)
    done.put((time.monotonic(), len(errors), sum(reconnects), errors[:3]))


def _bulk_client(target: str, aggregation: str, seeds: list[int], start, done) -> None:
    """One of the 8 reference clients: every update of ``seeds`` in one submission."""
    from clipd.client import Client

    updates = np.stack([_update(seed) for seed in seeds])
    with Client(target) as client:
        client.layers(aggregation)
        done.put("ready")
        start.wait()
        report = client.submit(aggregation, {"x": updates}, client_id=f"bulk-{seeds[0]}")
    done.put((time.monotonic(), 0, report.reconnects, []))


def _run(kind, target: str, aggregation: str, groups: list[list[int]], at_start=None) -> tuple[float, int, int, list]:
    """Runs the clients of ``groups`` (a process each) and starts them together (``at_start()`` just before)."""
    ctx = multiprocessing.get_context("spawn")
    start, done = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=kind, args=(target, aggregation, group, start, done)) for group in groups]
    for p in procs:
        p.start()
    for _ in procs:  # every client has its update, its channel and its layers
        if done.get(timeout=900) != "ready":
            raise RuntimeError("a client process reported before the start")
    time.sleep(0.2)  # the last ones reach ``start.wait()``
    if at_start is not None:
        at_start()
    t0 = time.monotonic()
    start.set()
    ends = [done.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    return max(e[0] for e in ends) - t0, sum(e[1] for e in ends), sum(e[2] for e in ends), \
        [x for e in ends for x in e[3]]


# Bare sinks: the gRPC runtime alone (sync thread pool or grpc.aio), for the choice of server -----

def _bare_request(seeds: list[int], per_message: int = 8) -> list[bytes]:
    """The serialized SubmitRequests of these updates (``per_message`` a message), as a client packs them."""
    from clipd import wire

    messages = []
    for sequence, start in enumerate(range(0, len(seeds), per_message), 1):
        part = np.stack([_update(seed) for seed in seeds[start : start + per_message]])
        messages += wire.submit_batch("bare", f"bare-{seeds[start]}", sequence, [part], 1 << 30, "x")
    return messages


def _bare_clients(target: str, aggregation: str, seeds: list[int], start, done) -> None:
    """One client process against a bare sink: a thread, a channel and one raw stream per seed
    (``aggregation == "round"``), or one stream carrying every seed's update (``"bulk"``)."""
    import grpc

    options = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20)]
    groups = [[seed] for seed in seeds] if aggregation == "round" else [seeds]
    errors: list[str] = []
    ready = threading.Barrier(len(groups) + 1)

    def one(group: list[int]) -> None:
        messages = _bare_request(group)
        try:
            with grpc.insecure_channel(target, options) as channel:
                grpc.channel_ready_future(channel).result(timeout=120)
                submit = channel.stream_stream("/clipd.v1.Clipd/Submit")
                ready.wait()
                start.wait()
                acks = list(submit(iter(messages), timeout=300))
                if len(acks) != len(messages):
                    errors.append(f"{len(acks)} acknowledgements for {len(messages)} messages")
        except threading.BrokenBarrierError:
            errors.append("not started")
        except Exception as e:  # counted
            errors.append(repr(e))
            ready.abort()

    _together(one, groups, ready, done)
    done.put((time.monotonic(), len(errors), 0, errors[:3]))


def bare_sink(port: int, kind: str) -> None:
    """``python benchmarks/round.py --bare-sink PORT sync|aio``: one sink process."""
    import grpc

    from clipd import wire

    options = [("grpc.so_reuseport", 1), ("grpc.max_receive_message_length", 16 << 20),
               ("grpc.max_concurrent_streams", 4096)]
    if kind == "sync":
        from scale import serve_sync_sink  # benchmarks/ is this script's directory

        def submit(requests, context):
            for raw in requests:
                yield _ack(wire.parse_submit_request(raw).sequence)

        serve_sync_sink(port, submit, 256, options)
        return
    import asyncio

    async def submit_async(requests, context):
        async for raw in requests:
            yield _ack(wire.parse_submit_request(raw).sequence)

    async def serve() -> None:
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "clipd.v1.Clipd", {"Submit": grpc.stream_stream_rpc_method_handler(submit_async)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


def _ack(sequence: int) -> bytes:
    """A SubmitResponse with ``acknowledged_sequence`` (field 1) set, as clipd sends it."""
    from clipd import wire

    return b"\x08" + wire.varint(sequence)


def measure_sink(kind: str, mode: str, processes: int, clients: int, client_processes: int, repeat: int):
    port = _free_port()
    sinks = [subprocess.Popen([sys.executable, __file__, "--bare-sink", str(port), kind], stdout=subprocess.PIPE,
                              text=True) for _ in range(processes)]
    try:
        for sink in sinks:
            if sink.stdout.readline() != "ready\n":
                raise RuntimeError("a bare sink did not start")
        target = f"127.0.0.1:{port}"
        seeds = [repeat * 1_000_000 + i for i in range(clients)]
        if mode == "round":
            groups = [seeds[i::client_processes] for i in range(client_processes)]
        else:
            groups = [seeds[i::8] for i in range(8)]
        cpu = [_server_cpu(p.pid) for p in sinks]
        at_start: list[float] = []
        wall, errors, _, samples = _run(_bare_clients, target, "round" if mode == "round" else "bulk", groups,
                                        lambda: at_start.append(sum(_server_cpu(p.pid) for p in sinks)))
        end = sum(_server_cpu(p.pid) for p in sinks)
        return wall, errors, 0, errors == 0, samples, end - sum(cpu), end - at_start[0]
    finally:
        for sink in sinks:
            sink.kill()
            sink.wait()


def _server_cpu(pid: int) -> float:
    """User + system CPU seconds so far of process ``pid`` and its children (clipd's shard processes)."""
    pids = [pid]
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    total = 0
    for p in pids:
        with contextlib.suppress(OSError), open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


# Where a clipd process's threads spend its CPU (``clipd serve`` names each native thread after its Python thread).
PARTS = (("clipd-device", "summing"), ("tf_", "summing"), ("clipd-committer", "durability"),
         ("clipd-one", "handlers"), ("clipd-grpc", "handlers"), ("clipd-shard-in", "handlers"),
         ("clipd-submit", "handlers"), ("clipd-first", "handlers"),
         ("event_engine", "gRPC"), ("grpc", "gRPC"), ("Thread-", "gRPC"))  # core's threads, the sync server's loop
PART_NAMES = ("gRPC", "handlers", "summing", "durability", "control", "other")


def _cpu_by_part(pid: int) -> dict[str, float]:
    """CPU seconds so far of ``clipd serve`` (pid) and its shard processes, by part: ``gRPC`` (the runtime's
    threads and the server's loop), ``handlers`` (the RPCs' threads: session, parsing, waiting for durability),
    ``summing`` (the device worker, XLA's threads), ``durability`` (the committer), ``control`` (the control
    process of shard processes, whole), ``other`` (the rest, threads that ended included)."""
    parts = dict.fromkeys(PART_NAMES, 0.0)
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(p) for p in f.read().split()]
    if children:  # the control process holds no payload: counted whole
        parts["control"] = _server_cpu(pid) - sum(_process_cpu(c) for c in children)
    for child in children or [pid]:  # (no shard processes: clipd serve sums itself, split by thread)
        live = 0.0
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{child}/task"):
                with contextlib.suppress(OSError):
                    with open(f"/proc/{child}/task/{task}/comm") as f:
                        name = f.read().strip()
                    with open(f"/proc/{child}/task/{task}/schedstat") as f:  # (ns: a thread's ticks would round
                        seconds = int(f.read().split()[0]) / 1e9           # each of hundreds of threads down)
                    part = next((p for prefix, p in PARTS if name.startswith(prefix)), "other")
                    parts[part] += seconds
                    live += seconds
        parts["other"] += max(0.0, _process_cpu(child) - live)
    return parts


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` alone (its threads, ended ones included)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def _reference(seeds: list[int]) -> np.ndarray:
    total = np.zeros(WIDTH)
    for seed in seeds:
        x = _update(seed).astype(np.float64)
        total += x * min(1.0, CLIP / np.linalg.norm(x))
    return total


def measure(mode: str, processes: int, clients: int, client_processes: int, workdir: str, repeat: int,
            store: str = "durable"):
    from clipd.client import Client

    port = _free_port()
    data_dir = os.path.join(workdir, f"data-{port}") if store == "durable" else "memory"
    server = subprocess.Popen(
        [sys.executable, "-m", "clipd", "serve", "--grpc-port", str(port), "--admin-port", "-1", "--data-dir",
         data_dir, "--processes", str(processes), "--compilation-cache-dir",
         os.path.join(workdir, "jax-cache"), "--log-level", "warning",
         "--no-warm-privacy"], stdout=subprocess.PIPE, text=True)  # (no private release: no accountant loaded)
    try:
        if "serving" not in server.stdout.readline():
            raise RuntimeError("clipd serve did not start")
        target = f"127.0.0.1:{port}"
        seeds = [repeat * 1_000_000 + i for i in range(clients)]
        with Client(target) as c:
            aggregation = c.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP)
            c.submit(aggregation, {"x": np.zeros((1, WIDTH), np.float32)}, client_id="warm-up")
        cpu = _server_cpu(server.pid)
        at_start: list[float] = []
        parts: list[dict[str, float]] = []

        def started() -> None:
            at_start.append(_server_cpu(server.pid))
            parts.append(_cpu_by_part(server.pid))

        if mode == "round":
            groups = [seeds[i::client_processes] for i in range(client_processes)]
            wall, errors, reconnects, samples = _run(_round_clients, target, aggregation, groups, started)
        else:
            groups = [seeds[i::8] for i in range(8)]
            wall, errors, reconnects, samples = _run(_bulk_client, target, aggregation, groups, started)
        end = _server_cpu(server.pid)
        by_part = {k: v - parts[0][k] for k, v in _cpu_by_part(server.pid).items()}
        with Client(target) as c:
            result = c.finalize(aggregation)
        expected = _reference(seeds)
        exact = result.examples == clients + 1 and bool(
            np.allclose(result.sums["x"], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max()))
        return wall, errors, reconnects, exact, samples, end - cpu, end - at_start[0], by_part
    finally:
        stop_process(server)


def _table(gb: float, runs: dict[str, list], clients: int) -> dict[str, float]:
    """Prints the medians; ``server CPU s``: from before the clients connect (their connections and calls before
    the start included); ``ms/client``: the server's CPU from the start to the end, per client."""
    print(f"{'mode':<20}| {'wall s':>7} | {'GB/s':>6} | {'server CPU s':>12} | {'ms/client':>9} | {'errors':>6} |"
          f" {'reconnects':>10} | exact")
    print("-" * 95)
    table = {}
    for mode, results in runs.items():
        wall = statistics.median(r[0] for r in results)
        table[mode] = gb / wall
        per_client = statistics.median(r[6] for r in results) / clients * 1e3
        table[f"{mode} ms/client"] = per_client
        print(f"{mode:<20}| {wall:7.3f} | {gb / wall:6.3f} | {statistics.median(r[5] for r in results):12.2f} |"
              f" {per_client:9.2f} | {max(r[1] for r in results):6d} |"
              f" {statistics.median(r[2] for r in results):10.0f} | {all(r[3] for r in results)}")
    return table


def main() -> None:
    if sys.argv[1:2] == ["--bare-sink"]:
        bare_sink(int(sys.argv[2]), sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=2000)
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2,
                        help="shard processes of clipd serve (0: none, it sums itself), or sinks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sinks", action="store_true", help="bare sync and grpc.aio sinks instead of clipd")
    parser.add_argument("--update-kib", type=int, default=256, help="KiB of one client's update (float32)")
    parser.add_argument("--store", choices=("durable", "memory"), default="durable",
                        help="clipd's store: a data directory (SQLite), or memory (one process: --processes 0)")
    args = parser.parse_args()
    if args.store == "memory" and args.processes:
        parser.error("--store memory runs one process: add --processes 0 (shard processes share a durable store)")
    global WIDTH
    WIDTH = args.update_kib * 256
    os.environ["CLIPD_ROUND_WIDTH"] = str(WIDTH)  # (the client processes are spawned: they read it at import)
    gb = args.clients * WIDTH * 4 / 1e9
    what = f"bare sinks x {args.processes}" if args.sinks else \
        f"clipd serve --processes {args.processes}, {args.store} store"
    print(f"round benchmark: {args.clients} clients x one update of {WIDTH * 4:,} B = {gb:.3f} GB; {what};"
          f" {args.repeats} repeats, medians")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    if args.sinks:
        runs = {f"{kind} {mode}": [] for kind in ("sync", "aio") for mode in ("round", "8 clients")}
        for repeat in range(args.repeats):
            for key in (list(runs) if repeat % 2 == 0 else list(reversed(runs))):
                kind, mode = key.split(" ", 1)
                run = measure_sink(kind, mode, args.processes, args.clients, args.client_processes, repeat)
                runs[key].append(run)
                print(f"  repeat {repeat + 1}: {key:>15}: {run[0]:.2f} s, server CPU {run[5]:.2f} s ({run[6]:.2f} s from the start), errors {run[1]}"
                      f" {run[4][:1]}", flush=True)
        print()
        table = _table(gb, runs, args.clients)
        print()
        ratios = {kind: table[f"{kind} round"] / table[f"{kind} 8 clients"] for kind in ("sync", "aio")}
        print(f"sinks: clients={args.clients} sync_round_ratio={ratios['sync']:.3f} aio_round_ratio={ratios['aio']:.3f}"
              f" aio_over_sync_round={table['aio round'] / table['sync round']:.3f}")
        return
    workdir = tempfile.mkdtemp(prefix="clipd-round-")
    runs = {"round": [], "8 clients": []}
    try:
        for repeat in range(args.repeats):
            for mode in (("round", "8 clients") if repeat % 2 == 0 else ("8 clients", "round")):
                run = measure(mode, args.processes, args.clients, args.client_processes, workdir, repeat, args.store)
                runs[mode].append(run)
                print(f"  repeat {repeat + 1}: {mode:>9}: {run[0]:.2f} s, server CPU {run[5]:.2f} s ({run[6]:.2f} s from the start), errors {run[1]},"
                      f" reconnects {run[2]}, exact {run[3]} {run[4][:1]}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    table = _table(gb, runs, args.clients)
    exact = all(r[3] for results in runs.values() for r in results)
    errors = max(r[1] for r in runs["round"])
    print()
    print()
    print("server CPU from the start, ms per client, by part (medians):")
    for mode, results in runs.items():
        split = {part: statistics.median(r[7][part] for r in results) / args.clients * 1e3 for part in PART_NAMES}
        print(f"  {mode:<10} " + "  ".join(f"{part} {ms:.2f}" for part, ms in split.items()))
    retries = statistics.median(r[2] for r in runs["round"]) / args.clients
    print(f"round: clients={args.clients} exact={exact} errors={errors}"
          f" throughput_ratio={table['round'] / table['8 clients']:.3f} retries_per_client={retries:.3f}"
          f" server_ms_per_client={table['round ms/client']:.2f}")


if __name__ == "__main__":
    main()
