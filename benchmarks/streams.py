"""Buffered streams benchmark: what never waiting buys, and what a stream costs the server.

Three tables:

1. **Rounds against a stream** (``examples/async_digits.py``, run in this process with its embedded server): N
   simulated clients with lognormal training times (sigma 1), synchronous rounds of m against a stream of K =
   m with m clients training at once, the same noise and the same participation limit (the same epsilon): the
   wall time of the synchronous run, the time the asynchronous one takes to reach the synchronous run's final
   accuracy, and their ratio; seeds alternated, medians.
2. **Server CPU per contribution**: a real ``clipd serve`` process (its CPU read from /proc), ``--contributions``
   updates of 256 KiB from 8 client threads, as one-message submissions to a round (``unit="client"``,
   SubmitOne: ``benchmarks/round.py``'s path) and as stream contributions (SubmitToStream, K = 10 and 100),
   interleaved; medians, and stream/round.
3. **Release latency** at 2^20 float32 parameters: the time from the K-th contribution's acknowledgement to the
   release being readable by a watcher (WatchReleases), beside the noise's draw for that model alone (JAX's
   normal on the host's device, timed in this process).

Run: ``python benchmarks/streams.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOKEN = "bench-admin-token"


def example_table(seeds: int, clients: int, quick: bool) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import async_digits

    rows = []
    for seed in range(seeds):
        argv = ["--clients", str(clients), "--seed", str(seed)]
        if quick:
            argv += ["--rounds", "4", "--median-seconds", "0.02"]
        rows.append(async_digits.main(argv))
    sync = [r["sync"]["wall_s"] for r in rows]
    reach = [r["async"]["wall_s"] for r in rows]
    ratios = [a / s for a, s in zip(reach, sync)]
    print()
    print(f"rounds against a stream: {clients} clients, lognormal times (sigma 1), {seeds} seeds")
    print(f"{'seed':>4} | {'sync s':>7} | {'sync acc':>8} | {'sync eps':>8} | {'async s to it':>13} |"
          f" {'async acc':>9} | {'async eps':>9} | {'ratio':>6}")
    for seed, r, ratio in zip(range(seeds), rows, ratios):
        print(f"{seed:>4} | {r['sync']['wall_s']:>7.2f} | {r['sync']['accuracy']:>8.4f} | {r['sync']['epsilon']:>8.4g}"
              f" | {r['async']['wall_s']:>13.2f} | {r['async']['accuracy']:>9.4f} | {r['async']['epsilon']:>9.4g} |"
              f" {ratio:>6.2f}")
    print(f"streams: async_over_sync_median={statistics.median(ratios):.3f}")


def _server(data_dir: str, port: int, cache: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "clipd", "serve", "--host", "127.0.0.1", "--grpc-port", str(port),
                             "--admin-port", "-1", "--data-dir", data_dir, "--admin-token", TOKEN,
                             "--compilation-cache-dir", cache, "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from clipd.client import Client, ClipdError

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until it answers (a stream it has not: NOT_FOUND)
        try:
            with Client(f"127.0.0.1:{port}", token=TOKEN, retry_timeout=0.5, timeout=2.0) as c:
                c.stream("probe")
        except ClipdError as e:
            if getattr(e.code, "name", "") == "NOT_FOUND":
                return proc
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("clipd serve did not start")


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_table(contributions: int, repeats: int, sizes: list[int]) -> None:
    from clipd.client import Buffer, Client, Privacy

    params = 1 << 16  # 256 KiB of float32
    update = (np.random.default_rng(0).standard_normal(params) * 0.001).astype(np.float32)
    with tempfile.TemporaryDirectory() as data_dir, tempfile.TemporaryDirectory() as cache:
        port = _free_port()
        server = _server(data_dir, port, cache)
        target = f"127.0.0.1:{port}"
        try:
            def privacy() -> Privacy:
                return Privacy(f"cpu-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=1.0, max_participations=10,
                               min_separation=1)

            def round_once() -> float:  # the whole round: created, every client's update, its release
                with Client(target, token=TOKEN) as admin:
                    before = _cpu(server.pid)
                    agg = admin.create_aggregation({"w": (params,)}, l2_norm_clip=1.0, privacy=privacy(),
                                                   unit="client")
                    with concurrent.futures.ThreadPoolExecutor(8) as pool:
                        list(pool.map(lambda i: admin.submit(agg, {"w": update[None]}, client_id=f"c{i}"),
                                      range(contributions)))
                    admin.finalize(agg)
                    used = _cpu(server.pid) - before
                    admin.cancel(agg)
                return used / contributions

            def stream_once(size: int) -> float:  # the whole stream: made, every contribution, every release
                with Client(target, token=TOKEN) as admin:
                    before = _cpu(server.pid)
                    sid = admin.create_stream({"w": (params,)}, l2_norm_clip=1.0, privacy=privacy(),
                                              buffer=Buffer(size=size, max_staleness=10_000))
                    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # (each device knows its count: 1)
                        list(pool.map(lambda i: admin.submit_to_stream(sid, {"w": update}, trained_from=0,
                                                                       client_id=f"c{i}", sequence=1),
                                      range(contributions)))
                    next(admin.watch_releases(sid, after=contributions // size - 1, timeout=120))
                    used = _cpu(server.pid) - before
                    admin.stop_stream(sid)
                return used / contributions

            round_once(), stream_once(sizes[0])  # (compiles)
            rounds: list[float] = []
            streams: dict[int, list[float]] = {size: [] for size in sizes}
            for k in range(repeats):
                order = ["round", *sizes]
                for what in order[::-1] if k % 2 else order:
                    if what == "round":
                        rounds.append(round_once())
                    else:
                        streams[int(what)].append(stream_once(int(what)))
        finally:
            server.terminate()
            server.wait(30)
    a = statistics.median(rounds)
    print()
    print(f"server CPU per contribution: {contributions} updates of 256 KiB, 8 client threads, a clipd serve"
          f" process, medians of {repeats} interleaved; a round of them all (created, summed, released), or a"
          f" stream releasing every K (made, summed, every release)")
    print(f"{'path':>32} | {'ms CPU a contribution':>22} | {'/ round':>8}")
    print(f"{'round (SubmitOne)':>32} | {a * 1e3:>22.3f} | {1.0:>8.2f}")
    for size, measured in streams.items():
        b = statistics.median(measured)
        print(f"{f'stream, K = {size} (SubmitToStream)':>32} | {b * 1e3:>22.3f} | {b / a:>8.2f}")
    print("streams: " + " ".join(f"cpu_stream_over_round_k{size}={statistics.median(m) / a:.3f}"
                                 for size, m in streams.items()))


def latency_table(params: int, releases: int) -> None:
    import jax

    from clipd.client import Buffer, Client, Privacy
    from clipd.engine import _privacy as dp
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    size = 4
    with tempfile.TemporaryDirectory() as data_dir:
        server, port = create_server(Settings(host="127.0.0.1", grpc_port=0, admin_port=-1, data_dir=data_dir,
                                              admin_token=TOKEN, log_level="warning",
                                              max_message_bytes=64 << 20))
        try:
            with Client(f"127.0.0.1:{port}", token=TOKEN, max_message_bytes=64 << 20) as admin:
                sid = admin.create_stream({"w": (params,)}, l2_norm_clip=1.0, buffer=Buffer(size=size,
                                                                                          max_staleness=10_000),
                                          privacy=Privacy(f"lat-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=1.0,
                                                          max_participations=100, min_separation=1))
                update = (np.random.default_rng(0).standard_normal(params) * 1e-4).astype(np.float32)
                got: dict[int, float] = {}

                def watch() -> None:
                    with Client(f"127.0.0.1:{port}", token=TOKEN, max_message_bytes=64 << 20) as w:
                        for release in w.watch_releases(sid, timeout=600):
                            got[release.version] = time.perf_counter()
                            if release.version >= releases + 1:
                                return

                watcher = threading.Thread(target=watch, daemon=True)
                watcher.start()
                acked: dict[int, float] = {}
                for version in range(1, releases + 2):
                    for i in range(size):
                        admin.submit_to_stream(sid, {"w": update}, trained_from=0, client_id=f"l{version}-{i}")
                    acked[version] = time.perf_counter()
                    while version not in got:
                        time.sleep(0.001)
                watcher.join(60)
        finally:
            server.stop(grace=1.0)
    latencies = [got[v] - acked[v] for v in range(2, releases + 2)]  # (the first compiles)
    zeros = [np.zeros(params, np.float64)]
    dp.add_gaussian_noise(zeros, 1.0, dp.fresh_key(), [np.dtype(np.float32)])
    draws = []
    for _ in range(releases):
        started = time.perf_counter()
        jax.block_until_ready(dp.add_gaussian_noise(zeros, 1.0, dp.fresh_key(), [np.dtype(np.float32)]))
        draws.append(time.perf_counter() - started)
    lat, draw = statistics.median(latencies), statistics.median(draws)
    print()
    print(f"release latency: {params:,} float32 parameters, K = {size}, medians of {releases}")
    print(f"{'K-th acknowledgement to the release read, ms':>46} | {'noise draw alone, ms':>20} | the rest, ms")
    print(f"{lat * 1e3:>46.1f} | {draw * 1e3:>20.1f} | {(lat - draw) * 1e3:.1f}")
    print(f"streams: release_latency_ms={lat * 1e3:.1f} noise_draw_ms={draw * 1e3:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small runs (a smoke run)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=60)
    parser.add_argument("--contributions", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--buffer", default="10,100", help="the streams' K in the CPU table (comma-separated)")
    parser.add_argument("--only", choices=("example", "cpu", "latency"))
    args = parser.parse_args()
    if args.only in (None, "example"):
        example_table(1 if args.quick else args.seeds, 20 if args.quick else args.clients, args.quick)
    if args.only in (None, "cpu"):
        cpu_table(40 if args.quick else args.contributions, 1 if args.quick else args.repeats,
                  [10] if args.quick else [int(k) for k in args.buffer.split(",")])
    if args.only in (None, "latency"):
        latency_table(1 << 14 if args.quick else 1 << 20, 3 if args.quick else 11)


if __name__ == "__main__":
    main()
