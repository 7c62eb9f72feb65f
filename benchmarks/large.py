"""Large updates: cross-silo federated learning, one whole-model update per client, streamed into clipd.

What runs (loopback, a fresh ``clipd serve`` subprocess per row, ``--processes 0``): a model of P
float32 parameters in 8 layers of P/8 each (shape ``(P/8,)``), one aggregation with global
clipping at C = 1.0, and 4 clients, each its own ``Client`` (its own channel) and client id, at
most 2 submitting at once (two threads, each running 2 clients in turn):

  large    each client submits ONE example: its whole update ``x_i = c_i * v`` (v: one fixed,
           seeded random float32 vector of P elements with ||v|| about 1; c_i = 0.25, 0.5, 2, 4,
           powers of two, so x_i is exact in float32 and two of the four are clipped). A thread
           computes x_i into one reusable buffer of its own when it is that client's turn (the
           first one before the clock starts); the client gets ``{layer: x_i[None]}``, views of it.
  1 MiB    the reference for throughput, the same bytes as 1 MiB examples: a layer spec of one
           float32 layer of 262,144 values, each client submitting P / 262,144 examples from a
           generator (made one at a time from slices of v, scaled by c_i and a power of two g, so
           that again the examples of two clients are clipped and two are not).

The large rows run against the server's memory store (``--data-dir memory``) and its durable
store (a fresh temporary directory: SQLite plus checkpoint files, fsynced); the 1 MiB row
against the memory store (``--small-durable`` adds it on the durable store too). Each row's
server is started with ``--max-parameters P`` (room for the model) and otherwise its defaults;
``--server-arg`` (repeatable) appends flags to its command line. It is a plain ``clipd serve``:
this process's environment as it is (clipd serve tunes its allocator and BLAS threads itself).

The clock (column ``clock``) of a ``create`` row runs from the aggregation's creation, the clients
sending at once (as a user's round goes: each client reads the layers, then submits, while the
aggregation may still be warming up), to the last acknowledgement (the last ``submit`` returning);
an ``open`` row (large, memory store) waits for the aggregation to be OPEN and its clients to have
read the layers, then runs from the first submit. The Finalize (called right after) is timed on its
own. Computing the update buffers of the second clients (and the 1 MiB examples)
is inside the clock, the same bytes multiplied in both kinds of rows. The server's memory is its
process tree's (``clipd serve`` and all its descendants) VmRSS summed, sampled every 25 ms by a
thread from ``/proc/<pid>/status``; the idle RSS is measured once the server has started, before
the aggregation is created (so the peak counts its sums: 12 bytes a parameter, 3 updates' worth),
and the peak is sampled until the Finalize has returned.

Columns: case, store, clock, params (P), examples (all clients', as the finalized aggregation counts
them), clipped (as it counts them: 2 of the 4 large examples, half of the 1 MiB ones), submit s
(creation, or the first submit, to the last acknowledgement), finalize s, GB/s (payload bytes, 4 x P x 4, over the submit
seconds: until every update is durably acknowledged; 1 GB = 1e9 bytes; the Finalize, which returns
a sum as large as one update for the large rows and of 1 MiB for the small one, has its own column), peak/update (the peak RSS of the server's tree minus its
idle RSS, over the update size P x 4 bytes), reconnects (the sum of ``SubmitReport.reconnects``),
errors (client and server errors, each one listed below the table), exact (the finalized sums
against a float64 reference of the clipped sum, ``max |result - reference| <= 1e-6 * max
|reference|``, and the example count; the relative error in brackets). With ``--repeats N`` every
row runs N times (the order reversed every other repeat); the table shows medians (reconnects and
errors summed, exact only if every repeat was).

Robustness: every client call is caught, so an error is reported in its row (whose timings are then
nan) and the run goes on with the next row; each server is stopped in a ``finally`` (and gets
SIGTERM should this process die); ``--timeout`` bounds each row, from the server's start to the
check (1800 s, ``--quick`` 30 s).

Per P, two ratios: ``memory_over_small`` (large on the memory store over 1 MiB examples, GB/s)
and ``durable_over_memory`` (large, durable over memory); then, per P (the largest last)::

    large: params=<P> gbps_memory=<a> gbps_durable=<b> gbps_small=<c> peak_over_update=<d> gbps_memory_from_open=<e>

a, b, c: the ``create`` rows; d: the larger peak/update of the two large ``create`` rows; e: the
``open`` row. The last line is the one for the largest P.

Run::

    python benchmarks/large.py                      # P = 2^28 and 2^29 (1 GiB and 2 GiB an update)
    python benchmarks/large.py --params 268435456   # one P
    python benchmarks/large.py --huge               # also P = 2^30 (4 GiB an update)
    python benchmarks/large.py --quick              # P = 2^22 (16 MiB), a smoke run of a few seconds
    python benchmarks/large.py --rounds 3 --params 268435456   # rounds of a job: each one's warm-up (to OPEN)
                                                    # beside a fresh process touching the memory the server
                                                    # then holds: before the rounds, the memory idle as the
                                                    # first warm-up finds it (``first_open_over_idle_touch``),
                                                    # and right after them (``first_open_over_touch``)
    python benchmarks/large.py --server-arg=--max-batch-bytes=2147483648 --server-arg=--max-buffered-bytes=4294967296

The benchmark process holds v, one buffer per thread and the finalized sums (about 4 x P x 4
bytes, plus the float64 checks done in chunks); the server what it needs. From P = 2^30 (or with
``--disk-backed``) v and the buffers are files mapped into memory (the kernel writes their pages
out and drops them as it needs), so that client and server fit a 24 GB machine side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import math
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

import numpy as np
from scale import stop_process  # benchmarks/scale.py (benchmarks/ is this script's directory)

LAYERS = 8
SMALL_WIDTH = 262_144  # float32: 1 MiB an example
CLIP = 1.0
SCALARS = (0.25, 0.5, 2.0, 4.0)  # c_i: powers of two (exact in float32); ||v|| ~ 1, so the last two are clipped
CLIENTS = len(SCALARS)
AT_ONCE = 2  # clients submitting at once (threads)
TOLERANCE = 1e-6  # max |result - reference| <= TOLERANCE * max |reference|
SAMPLE_INTERVAL = 0.025  # seconds between RSS samples
CHECK_CHUNK = 1 << 22  # elements per chunk of the float64 checks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The server's memory ---------------------------------------------------------------------------
def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc/<pid>/task/<tid>/children)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return pids


def tree_rss(pid: int) -> int:
    """Bytes: the VmRSS of ``pid`` and its descendants, summed."""
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError), open(f"/proc/{p}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
    return total


class RssSampler:
    """The peak of ``tree_rss(pid)``, sampled every ``interval`` seconds on a thread of its own."""

    def __init__(self, pid: int, interval: float = SAMPLE_INTERVAL) -> None:
        self.pid, self.interval = pid, interval
        self.peak = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def sample(self) -> int:
        rss = tree_rss(self.pid)
        self.peak = max(self.peak, rss)
        self.samples += 1
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


# The server ---------------------------------------------------------------------------------------
# ``clipd serve ARGS`` that gets SIGTERM should this process die, even killed (a test's timeout):
# PR_SET_PDEATHSIG (1), kept across the exec; argv[1] is this process's pid (if it died already, exit).
_SERVE = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM);"
          " os.getppid() == int(sys.argv[1]) or sys.exit('clipd serve: the benchmark is gone');"
          " os.execv(sys.executable, [sys.executable, '-m', 'clipd', 'serve', *sys.argv[2:]])")


class Server:
    """``clipd serve`` on free loopback ports, with ``data_dir`` and the extra flags; stop() always."""

    def __init__(self, data_dir: str, params: int, workdir: str, extra: list[str], start_timeout: float) -> None:
        """A plain ``clipd serve``: the environment as it is, what a pip-installed one gets (it tunes itself)."""
        self.port = _free_port()
        command = [sys.executable, "-c", _SERVE, str(os.getpid()), "--grpc-port", str(self.port),
                   "--admin-port", "-1", "--data-dir", data_dir,
                   "--max-parameters", str(params),
                   "--compilation-cache-dir", os.path.join(workdir, "jax-cache"), "--log-level", "warning",
                   "--no-warm-privacy", *extra]  # (no private release here: the privacy accountant is not loaded)
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []  # its last lines, for an error message
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, args=(self.proc.stdout, lines.put), daemon=True).start()
        threading.Thread(target=self._drain, args=(self.proc.stderr, self._keep), daemon=True).start()
        try:
            line = lines.get(timeout=start_timeout)  # "clipd serving gRPC on ...", or "" if it exited
        except queue.Empty:
            line = ""
        if "serving" not in line:
            self.stop()
            time.sleep(0.1)  # its last words on stderr
            raise RuntimeError(f"clipd serve did not start: {line!r} {' '.join(self.stderr[-3:])}")
        self.target = f"127.0.0.1:{self.port}"

    def _keep(self, line: str) -> None:
        self.stderr = (self.stderr + [line.strip()])[-20:]

    @staticmethod
    def _drain(stream, put) -> None:
        """Reads the pipe to its end (so the server never blocks on a full one), then puts "" (EOF)."""
        with contextlib.suppress(ValueError, OSError):
            for line in stream:
                put(line)
        put("")

    def stop(self) -> None:
        stop_process(self.proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


# Updates and references -----------------------------------------------------------------------------
def float32_array(params: int, disk: str | None) -> np.ndarray:
    """P uninitialised float32: in memory, or (``disk``: a folder) a file mapped into memory, whose pages the
    kernel may write out and drop (so a 2^30 model's updates leave the memory to the server)."""
    if disk is None:
        return np.empty(params, np.float32)
    fd, path = tempfile.mkstemp(prefix="update-", dir=disk)
    os.close(fd)
    return np.memmap(path, np.float32, "w+", shape=(params,))


def base_vector(params: int, seed: int, disk: str | None = None) -> np.ndarray:
    """v: P float32 values, standard normal / sqrt(P) (so ||v|| is about 1), made in chunks."""
    rng = np.random.default_rng(seed)
    v = float32_array(params, disk)
    scale = np.float32(1 / math.sqrt(params))
    for start in range(0, params, CHECK_CHUNK):
        part = v[start : start + CHECK_CHUNK]
        rng.standard_normal(part.shape, dtype=np.float32, out=part)
        part *= scale
    return v


def norm64(x: np.ndarray) -> float:
    """||x|| in float64, in chunks (no float64 copy of all of x)."""
    total = 0.0
    for start in range(0, x.size, CHECK_CHUNK):
        part = x[start : start + CHECK_CHUNK].astype(np.float64)
        total += float(np.dot(part, part))
    return math.sqrt(total)


def small_gain(params: int) -> float:
    """g: the power of two nearest sqrt(P / 262,144), so that a 1 MiB slice of g * v has a norm of about 1."""
    return 2.0 ** round(math.log2(math.sqrt(params / SMALL_WIDTH)))


def large_check(sums: dict[str, np.ndarray], names: list[str], v: np.ndarray) -> float:
    """max |result - reference| / max |reference|, reference = (sum_i min(1, C/||x_i||) c_i) v in float64."""
    norm_v = norm64(v)
    s = sum(min(1.0, CLIP / (abs(c) * norm_v)) * c for c in SCALARS)
    width = v.size // len(names)
    worst = top = 0.0
    for k, name in enumerate(names):
        got = np.asarray(sums[name]).reshape(-1)
        if got.size != width:
            raise AssertionError(f"layer {name}: {got.size} values, expected {width}")
        for start in range(0, width, CHECK_CHUNK):
            end = min(start + CHECK_CHUNK, width)
            ref = s * v[k * width + start : k * width + end].astype(np.float64)
            worst = max(worst, float(np.max(np.abs(got[start:end] - ref))))
            top = max(top, float(np.max(np.abs(ref))))
    return worst / top


def small_examples(v: np.ndarray, scale: float):
    """The 1 MiB examples of one client: ``scale * v[j*W:(j+1)*W]``, made one at a time."""
    factor = np.float32(scale)
    for start in range(0, v.size, SMALL_WIDTH):
        yield {"x": v[start : start + SMALL_WIDTH] * factor}


def small_check(total: np.ndarray, v: np.ndarray, gain: float) -> float:
    """The same error for the 1 MiB row: reference = sum_j (sum_i min(1, C/||g c_i v_j||) g c_i) v_j."""
    ref = np.zeros(SMALL_WIDTH)
    for start in range(0, v.size, SMALL_WIDTH):
        part = v[start : start + SMALL_WIDTH].astype(np.float64)
        norm = math.sqrt(float(np.dot(part, part)))
        ref += sum(min(1.0, CLIP / (abs(gain * c) * norm)) * gain * c for c in SCALARS) * part
    return float(np.max(np.abs(np.asarray(total, np.float64).reshape(-1) - ref)) / np.max(np.abs(ref)))


# One row ------------------------------------------------------------------------------------------------
class Row:
    def __init__(self, case: str, store: str, params: int, clock: str = "create") -> None:
        self.case, self.store, self.params, self.clock = case, store, params, clock
        self.examples = 0
        self.submit_s = self.finalize_s = math.nan
        self.peak_over_update = math.nan
        self.reconnects = 0
        self.clipped = 0
        self.errors: list[str] = []
        self.rel_error = math.nan
        self.exact = False

    @property
    def payload(self) -> int:
        return CLIENTS * self.params * 4

    @property
    def gbps(self) -> float:
        """Payload GB over the submit seconds (until all acknowledged); nan for a row with an error."""
        return self.payload / self.submit_s / 1e9 if not self.errors else math.nan


def _error(e: BaseException) -> str:
    details = getattr(e, "details", None)
    if callable(details):
        with contextlib.suppress(Exception):
            details = details()
    return f"{type(e).__name__}: {details or e}"[:300]


def measure(case: str, store: str, params: int, v: np.ndarray, workdir: str, extra: list[str],
            timeout: float, disk: str | None = None, clock: str = "create") -> Row:
    """One row: a fresh server, one aggregation, 4 clients (2 at once), Finalize, the check. ``clock``
    "create": the clients start as the aggregation is created (the clock with it, as a user's run goes);
    "open": they start once it is OPEN, the clock with them."""
    from clipd.client import Client

    row = Row(case, store, params, clock)
    deadline = time.monotonic() + timeout
    data_dir = "memory" if store == "memory" else tempfile.mkdtemp(prefix="data-", dir=workdir)
    large = case == "large"
    width = params // LAYERS
    names = [f"layer{k}" for k in range(LAYERS)] if large else ["x"]
    layers = {name: (width,) for name in names} if large else {"x": (SMALL_WIDTH,)}
    gain = 1.0 if large else small_gain(params)
    server = clients = None
    start, abort = threading.Event(), threading.Event()
    try:
        server = Server(data_dir, params, workdir, extra, start_timeout=min(120.0, timeout))
        idle = tree_rss(server.proc.pid)  # before the aggregation: its sums count in the peak
        clients = [Client(server.target, timeout=timeout, retry_timeout=min(60.0, timeout)) for _ in range(CLIENTS)]
        made: list[str] = []  # the aggregation, once created
        if clock == "open":
            made.append(clients[0].create_aggregation(layers, policy="global", l2_norm_clip=CLIP))
            _wait_open(clients[0], made[0], deadline)
            for client in clients:
                client.layers(made[0])  # connected, the layers known: nothing of it in the clock
        lock, ready = threading.Lock(), threading.Barrier(AT_ONCE + 1)
        reports = []

        def worker(turns: list[int]) -> None:
            buffer = float32_array(params, disk) if large else None

            def updates(i: int):
                if large:
                    np.multiply(v, np.float32(SCALARS[i]), out=buffer)
                    return {name: buffer[k * width : (k + 1) * width][None] for k, name in enumerate(names)}
                return small_examples(v, gain * SCALARS[i])

            try:
                first = updates(turns[0])
            except Exception as e:
                first = None
                with lock:
                    row.errors.append(f"client {turns[0]}: {_error(e)}")
            with contextlib.suppress(threading.BrokenBarrierError):
                ready.wait(timeout)
            start.wait()
            for n, i in enumerate(turns):
                if abort.is_set():
                    return
                try:
                    update = first if n == 0 else updates(i)
                    if update is None:
                        continue
                    client_id = f"{'large' if large else 'small'}-{i}"
                    report = clients[i].submit(made[0], update, client_id=client_id)
                    with lock:
                        reports.append(report)
                except Exception as e:  # reported in the row
                    with lock:
                        row.errors.append(f"client {i}: {_error(e)}")

        threads = [threading.Thread(target=worker, args=(list(range(t, CLIENTS, AT_ONCE)),), daemon=True)
                   for t in range(AT_ONCE)]
        for thread in threads:
            thread.start()
        ready.wait(max(1.0, deadline - time.monotonic()))  # every thread has its first update
        sampler = RssSampler(server.proc.pid)
        sampler.peak = tree_rss(server.proc.pid)
        with sampler:
            t0 = time.perf_counter()
            if clock == "create":  # the clients submit at once (each reads the layers first, as submit does)
                made.append(clients[0].create_aggregation(layers, policy="global", l2_norm_clip=CLIP))
            aggregation = made[0]
            start.set()
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            if any(thread.is_alive() for thread in threads):
                raise TimeoutError(f"the clients did not finish within {timeout:.0f} s (--timeout)")
            row.submit_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            result = clients[0].finalize(aggregation)
            row.finalize_s = time.perf_counter() - t1
        row.peak_over_update = (sampler.peak - idle) / (params * 4)
        row.reconnects = sum(r.reconnects for r in reports)
        row.examples = result.examples
        row.clipped = result.clip_counts[names[0]]
        expected = CLIENTS * (1 if large else params // SMALL_WIDTH)
        row.rel_error = large_check(result.sums, names, v) if large else small_check(result.sums["x"], v, gain)
        row.exact = row.rel_error <= TOLERANCE and row.examples == expected  # the examples column shows the count
    except Exception as e:  # the row reports it; the run goes on
        row.errors.append(_error(e))
        if server is not None and server.proc.poll() is not None:
            row.errors.append(f"clipd serve exited {server.proc.returncode}: {' | '.join(server.stderr[-3:])}")
    finally:
        abort.set()  # threads still waiting for the start (the row failed before it) return
        start.set()
        if clients:
            for client in clients:
                with contextlib.suppress(Exception):
                    client.close()
        if server is not None:
            server.stop()
        if data_dir != "memory":
            shutil.rmtree(data_dir, ignore_errors=True)
    return row


def rounds(params: int, count: int, v: np.ndarray, workdir: str, extra: list[str], timeout: float
           ) -> tuple[list[dict], float]:
    """``count`` rounds of a job on one plain ``clipd serve`` (memory store, no variables set), as a user runs
    them: each round's aggregation created, then at once 2 clients each send one whole update (the first two
    of the large rows'), then Finalize and cancel. Per round: seconds from creation to OPEN (its warm-up), and
    from creation to the last acknowledgement, and the payload GB/s over the latter; and the seconds a fresh
    process took to touch what the first round holds, before the rounds (the memory idle)."""
    from clipd.client import Client
    from clipd.v1 import clipd_pb2 as pb

    width = params // LAYERS
    names = [f"layer{k}" for k in range(LAYERS)]
    layers = {name: (width,) for name in names}
    updates = [np.multiply(v, np.float32(c)) for c in SCALARS[:AT_ONCE]]
    server = Server("memory", params, workdir, extra, start_timeout=min(120.0, timeout))
    out = []
    try:
        clients = [Client(server.target, timeout=timeout, retry_timeout=min(60.0, timeout)) for _ in range(AT_ONCE)]
        idle = tree_rss(server.proc.pid)
        # The reference, in the state the server's first warm-up finds the memory: a fresh process touches what
        # the first round will hold (its float64 totals and two receive buffers: 16 bytes a parameter), then
        # the machine idles as long as the next round's memory would (see FREED_IDLE_S).
        touch_idle = fresh_touch_seconds(16 * params)
        time.sleep(FREED_IDLE_S)
        for _ in range(count):
            opened: list[float] = []
            held: list[int] = []
            t0 = time.perf_counter()
            aggregation = clients[0].create_aggregation(layers, policy="global", l2_norm_clip=CLIP)

            def send(i: int, aggregation: str = aggregation) -> None:
                clients[i].submit(aggregation, {n: updates[i][k * width:(k + 1) * width][None]
                                                for k, n in enumerate(names)}, client_id=f"round-{i}")

            def watch(aggregation: str = aggregation, opened: list = opened, t0: float = t0,
                      held: list = held) -> None:
                with Client(server.target) as watcher:
                    while watcher.get_aggregation(aggregation).state == pb.Aggregation.WARMING_UP:
                        time.sleep(0.01)
                opened.append(time.perf_counter() - t0)
                held.append(tree_rss(server.proc.pid) - idle)  # what the server holds at OPEN, over its idle

            threads = [threading.Thread(target=send, args=(i,)) for i in range(AT_ONCE)]
            threads.append(threading.Thread(target=watch))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout)
            round_s = time.perf_counter() - t0
            clients[0].finalize(aggregation)
            clients[0].cancel(aggregation)
            out.append({"open_s": opened[0] if opened else math.nan, "round_s": round_s,
                        "gbps": AT_ONCE * params * 4 / round_s / 1e9, "held": held[0] if held else 0})
        for client in clients:
            client.close()
    finally:
        server.stop()
    return out, touch_idle


TOUCH = """
import sys, time
import numpy as np
started = time.perf_counter()
memory = np.empty(int(sys.argv[1]), np.uint8)
memory.fill(1)
print(time.perf_counter() - started)
"""


# Memory a process frees is handed back to the host by a VM whose balloon reports free pages (virtio-balloon's
# free page reporting, a couple of seconds after the free); touching it again then faults it in on the host too,
# several times slower than memory freed a moment ago. Pages freed this long ago have been reported.
FREED_IDLE_S = 10.0


def fresh_touch_seconds(nbytes: int) -> float:
    """Seconds a fresh process takes to allocate ``nbytes`` and write every page of it once (numpy imported
    first, outside the clock): what a warm-up that holds that much memory can't go under on this machine."""
    done = subprocess.run([sys.executable, "-c", TOUCH, str(nbytes)], capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def _wait_open(client, aggregation: str, deadline: float) -> None:
    from clipd.v1 import clipd_pb2 as pb

    while (state := client.get_aggregation(aggregation).state) != pb.Aggregation.OPEN:
        if state not in (pb.Aggregation.WARMING_UP, pb.Aggregation.STATE_UNSPECIFIED):
            raise RuntimeError(f"aggregation {aggregation} is {pb.Aggregation.State.Name(state)}, not OPEN")
        if time.monotonic() > deadline:
            raise TimeoutError(f"aggregation {aggregation} did not open (compile) in time")
        time.sleep(0.05)


# Output ----------------------------------------------------------------------------------------------------
HEADER = (f"{'case':<6} | {'store':<7} | {'clock':<6} | {'params':>10} | {'examples':>8} | {'clipped':>7} |"
          f" {'submit s':>8} |"
          f" {'finalize s':>10} | {'GB/s':>6} | {'peak/update':>11} | {'reconnects':>10} | {'errors':>6} | exact")


def summarize(runs: list[Row]) -> dict:
    """Medians over the repeats of a row (reconnects and errors summed, exact only if every repeat was)."""
    ok = [r for r in runs if not r.errors]

    def median(values) -> float:
        values = list(values)
        return statistics.median(values) if values else math.nan

    return dict(case=runs[0].case, store=runs[0].store, clock=runs[0].clock, params=runs[0].params,
                examples=runs[0].examples,
                clipped=runs[0].clipped,
                submit_s=median(r.submit_s for r in ok), finalize_s=median(r.finalize_s for r in ok),
                gbps=median(r.gbps for r in ok), peak=median(r.peak_over_update for r in ok),
                reconnects=sum(r.reconnects for r in runs), errors=sum(len(r.errors) for r in runs),
                exact=all(r.exact for r in runs),
                rel_error=max((r.rel_error for r in runs if not math.isnan(r.rel_error)), default=math.nan))


def print_row(s: dict) -> None:
    print(f"{s['case']:<6} | {s['store']:<7} | {s['clock']:<6} | {s['params']:>10} | {s['examples']:>8} |"
          f" {s['clipped']:>7} |"
          f" {s['submit_s']:8.3f} | {s['finalize_s']:10.3f} | {s['gbps']:6.3f} | {s['peak']:11.3f} |"
          f" {s['reconnects']:>10} |"
          f" {s['errors']:>6} | {s['exact']} ({s['rel_error']:.1e})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, nargs="+", default=None,
                        help="P, parameters of the model (default 2^28 and 2^29); multiples of 2,097,152")
    parser.add_argument("--huge", action="store_true", help="also P = 2^30 (4 GiB an update)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: P = 2^22 (16 MiB an update)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every row (medians shown)")
    parser.add_argument("--small-durable", action="store_true", help="the 1 MiB row on the durable store too")
    parser.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                        help="appended to the clipd serve command line (repeatable), e.g."
                             " --server-arg=--max-batch-bytes=2147483648")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a row may take, server start to the check (default 1800, quick 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disk-backed", action="store_true",
                        help="v and the clients' update buffers in files mapped into memory (on by itself from"
                             " P = 2^30: client and server then fit a 24 GB machine side by side)")
    parser.add_argument("--rounds", type=int, default=0, metavar="N",
                        help="instead: N rounds of a job on one plain clipd serve (see rounds()), per P")
    args = parser.parse_args()
    sizes = [1 << 22] if args.quick else (args.params or [1 << 28, 1 << 29])
    if args.rounds:
        run_rounds(sorted(set(sizes)), args)
        return
    if args.huge:
        sizes = sizes + [1 << 30]
    sizes = sorted(set(sizes))
    if any(p <= 0 or p % (LAYERS * SMALL_WIDTH) for p in sizes):
        parser.error(f"--params: positive multiples of {LAYERS * SMALL_WIDTH:,} (8 layers, whole 1 MiB examples)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    timeout = args.timeout or (30.0 if args.quick else 1800.0)
    cases = [("large", "memory", "create"), ("large", "durable", "create"), ("1 MiB", "memory", "create"),
             ("large", "memory", "open")]
    if args.small_durable:
        cases.append(("1 MiB", "durable", "create"))

    print(f"large benchmark: {CLIENTS} clients x one update of P float32 in {LAYERS} layers (global clip {CLIP},"
          f" c_i = {', '.join(map(str, SCALARS))}), {AT_ONCE} at once; P = {', '.join(f'{p:,}' for p in sizes)};"
          f" {args.repeats} repeat(s), medians; reference: the same bytes as 1 MiB examples")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()};"
          f" server flags: --max-parameters P {' '.join(args.server_arg)}".rstrip())
    workdir = tempfile.mkdtemp(prefix="clipd-large-")
    tables: dict[int, list[dict]] = {}
    all_errors: list[str] = []
    try:
        for params in sizes:
            disk = workdir if args.disk_backed or params >= 1 << 30 else None
            v = base_vector(params, args.seed, disk)
            runs: dict[tuple[str, str, str], list[Row]] = {case: [] for case in cases}
            for repeat in range(args.repeats):
                for case, store, clock in (cases if repeat % 2 == 0 else cases[::-1]):
                    row = measure(case, store, params, v, workdir, args.server_arg, timeout, disk, clock)
                    runs[(case, store, clock)].append(row)
                    all_errors += [f"P={params} {case}/{store}/{clock} repeat {repeat + 1}: {e}" for e in row.errors]
                    print(f"  P={params} repeat {repeat + 1}: {case:>5}/{store:<7}/{clock:<6} {row.gbps:.3f} GB/s,"
                          f" peak/update {row.peak_over_update:.3f}, errors {len(row.errors)}", flush=True)
            del v
            tables[params] = [summarize(runs[case]) for case in cases]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(HEADER)
    print("-" * len(HEADER))
    for rows in tables.values():
        for s in rows:
            print_row(s)
    if all_errors:
        print("\nerrors:")
        for error in all_errors:
            print(f"  {error}")
    print()
    lines = []
    for params, rows in tables.items():
        by = {(s["case"], s["store"], s["clock"]): s for s in rows}
        memory, durable = by[("large", "memory", "create")], by[("large", "durable", "create")]
        small, at_open = by[("1 MiB", "memory", "create")], by[("large", "memory", "open")]
        print(f"P={params}: memory_over_small={memory['gbps'] / small['gbps']:.3f}"
              f" durable_over_memory={durable['gbps'] / memory['gbps']:.3f}")
        peak = max(memory["peak"], durable["peak"])
        lines.append(f"large: params={params} gbps_memory={memory['gbps']:.3f} gbps_durable={durable['gbps']:.3f}"
                     f" gbps_small={small['gbps']:.3f} peak_over_update={peak:.3f}"
                     f" gbps_memory_from_open={at_open['gbps']:.3f}")
    for line in lines:
        print(line)


def run_rounds(sizes: list[int], args) -> None:
    print(f"rounds of a job: {args.rounds} rounds, each created then at once {AT_ONCE} clients x one update of P"
          f" float32 in {LAYERS} layers; a plain clipd serve (memory store); {os.cpu_count()} CPUs")
    print(f"{'params':>12} | {'round':>5} | {'open s':>7} | {'round s':>8} | {'GB/s':>6}")
    workdir = tempfile.mkdtemp(prefix="clipd-rounds-")
    try:
        for params in sizes:
            v = base_vector(params, args.seed)
            found, touch_idle = rounds(params, args.rounds, v, workdir, args.server_arg, args.timeout or 1800.0)
            for k, r in enumerate(found, start=1):
                print(f"{params:>12,} | {k:>5} | {r['open_s']:>7.3f} | {r['round_s']:>8.3f} | {r['gbps']:>6.3f}")
            held = found[0]["held"]
            touch = fresh_touch_seconds(held) if held > 0 else math.nan  # (after the rounds: nothing else runs)
            print(f"at OPEN the first round's server held {held / 1e9:.2f} GB over its idle; a fresh process"
                  f" allocates and touches {16 * params / 1e9:.2f} GB in {touch_idle:.3f} s before the rounds"
                  f" (memory idle, as the first warm-up finds it), as much as the server held in {touch:.3f} s"
                  f" right after them (memory the server just freed)")
            later = statistics.median(r["open_s"] for r in found[1:]) if len(found) > 1 else math.nan
            later_round = (statistics.median(r["round_s"] for r in found[1:]) / found[0]["round_s"]
                           if len(found) > 1 else math.nan)
            print(f"rounds: params={params} first_open_s={found[0]['open_s']:.3f} later_open_s={later:.3f}"
                  f" later_over_first_round_s={later_round:.3f} fresh_touch_s={touch:.3f}"
                  f" first_open_over_touch={found[0]['open_s'] / touch:.3f} idle_touch_s={touch_idle:.3f}"
                  f" first_open_over_idle_touch={found[0]['open_s'] / touch_idle:.3f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
