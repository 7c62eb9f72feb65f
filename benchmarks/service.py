"""Service benchmark: the clipd service (durable and in memory) end to end on loopback, against a bare gRPC sink.

What is measured, for every case (random normal float32 examples, drawn once
before any timing; global L2 bound = the median example norm, so about half
the examples are clipped):

  small/1-per-msg  1,024 params in 4 layers (4 KB an example), one example per
                   message (``Client(message_bytes=4096)``): per-message cost;
  small/batched    the same model, ~2 MiB messages (512 examples each, the
                   client's default ``message_bytes``);
  large            1,048,576 params in 8 layers (4 MiB an example), each
                   example split into two ~2 MiB messages.

Three servers run side by side, all started before any measurement:

durable  the real server (``create_server``) with ``data_dir`` = a fresh
         ``tempfile.mkdtemp()`` (``--durable-parent`` says where; default the
         system temp directory, which must be a local disk: the run prints its
         file system): the default kind of store, SQLite metadata plus
         checkpoint files, fsynced. Every other setting is the default
         (``checkpoint_interval`` 0.05 s, ``checkpoint_max_duty`` 0.25).
memory   the same server with ``data_dir="memory"`` (checkpoints go to a
         dict: the same group commit and acknowledgement path, no disk).
bare     a plain ``grpc.server`` (see below).

service  (durable and memory) ``Client.submit(aggregation, {name: (N, *shape)})``:
         the clock runs from the call to its return, i.e. until the server has
         acknowledged every batch. A batch is acknowledged only once a
         committed checkpoint covers it, so on the durable server the clock
         includes the checkpoints (flush of the device delta into the float64
         host totals, blob write, fsync, SQLite commit) that make the last
         batches durable; on the memory server the same checkpoints are
         commits into memory. It also includes the client's batching and
         encoding, gRPC, the server's decoding, validation, reassembly,
         queueing, the copy into the staging buffer and the jitted
         clip-and-sum steps. Warm-up is excluded: the aggregation is created,
         polled until OPEN (every bucket compiled) and fed a small untimed
         submit first. All repeats of a case on one server go into one
         aggregation (each with its own client id); it is then finalized and
         its example count checked.

bare     a plain ``grpc.server`` built with the same thread pool and message
         options, serving the same method path ``/clipd.v1.Clipd/Submit`` with
         a generic stream-stream handler that parses each request with the real
         ``SubmitRequest.FromString``, iterates the requests counting their
         bytes and examples, and answers one SubmitResponse at the end. It is
         driven through a channel made by the same ``Client`` class (same
         channel options) with a raw multi-callable for the same method (its
         serializer is ``SerializeToString``, and passes through requests that
         the client's encoder already made bytes). The requests are produced lazily,
         *inside* the timed region, by the client's own code: ``rebatch`` and
         ``iter_updates`` from ``clipd.client.updates`` and the client's
         encoder ``_BatchStream._encode`` (so every SubmitRequest is the one the
         client would send, and encoding is timed on both sides, just as
         ``Client.submit`` times it). The clock runs from the call until the
         single response has arrived.

So all sides pay the same client-side work and the same wire. The table's
ratios: ``dur/mem`` (durable / memory examples/s) is what durable
acknowledgements cost; ``mem/bare`` (memory / bare) is what the service loses
to its own work (decode, validate, copy, device step, acknowledgements and flow
control) relative to gRPC just moving the same bytes. ``mem/bare`` is the
``service / bare`` ratio of earlier versions of this script (which had no
store): it is computed with the memory server so that it stays comparable to
past runs. Client and servers run in this one process by default, as a user's
in-process test would (they share the GIL and the 2 cores); ``--server-process``
runs all three servers in one child process instead.

The measurements of a case are interleaved: each repeat runs durable, memory,
bare, and the next one the reverse order, ``--repeats`` times (default 3); the
table shows medians. GB/s counts payload bytes (examples x bytes per example)
per second, 1 GB = 1e9 bytes.

Acknowledgement latency (a separate measurement, after the cases, on the
durable and memory servers): one aggregation of the small model per server;
one Submit stream at a time sends batches of a single example (4 KB), each
only after the previous one is acknowledged; the clock of a batch runs from
the moment its message is handed to gRPC (the stream's request iterator
yields it) until the acknowledgement covering it arrives, so it is the
latency of one durable acknowledgement with nothing else in flight. Two
kinds, reported as median and p90 in ms:

  back-to-back     the next batch goes as soon as the previous one is
                   acknowledged (the first batch of each stream is not
                   counted): checkpoints of the aggregation start at most
                   every ``checkpoint_interval``, so this is about that
                   interval, on either server;
  after idle       each batch goes after a pause of 2 x ``checkpoint_interval``
                   with nothing in flight, so its checkpoint is due at once:
                   the fixed cost of one acknowledgement (fill wait, step,
                   flush, commit, ack), which on the durable server includes
                   the blob write, the fsyncs and the SQLite commit.

Per server: ``--pings`` back-to-back batches (default 100, quick 8; 0 skips
the measurement) and half as many (rounded up) after idle, each kind split
over two rounds of one stream per server, the servers' order alternating;
3 untimed batches go first. Every aggregation is finalized and its example
count checked. Acknowledgements under load (during the throughput runs) are
not timed here: ``Client.submit`` only returns the total.

The process tunes itself as ``clipd serve`` does at start-up, nothing more
(``clipd._process.tune``: glibc's mmap threshold, single-threaded OpenBLAS; an
environment that sets them wins), so the servers here run as a user's do. It
uses the sync gRPC API throughout.

The last two lines are machine-readable:
``durable_vs_memory_ratio=<x>``: the smaller of the small/batched and large
``dur/mem`` ratios (the issue asks for >= 0.9); then
``service_vs_bare_grpc_ratio=<x>``: the smaller of the small/batched and large
``mem/bare`` ratios (the issue asks for >= 0.85 in both, and >= 200,000
examples/s for small/batched).

Run:  python benchmarks/service.py                    (full run, ~3 minutes on 2 cores)
      python benchmarks/service.py --server-process   (servers in a child process)
      python benchmarks/service.py --quick            (tiny smoke run, < 30 s)
"""

from __future__ import annotations

import os
import sys

from clipd import _process  # (the standard library only: numpy is not loaded yet)

if __name__ == "__main__":  # as `clipd serve` sets itself up at start-up (before numpy loads): clipd/_process.py
    _process.tune()
    _process.name_threads()
TUNED = tuple(_process.SETTINGS)  # what the environment line shows

import argparse  # noqa: E402  (after the tuning on purpose: OpenBLAS reads its variable as numpy loads)
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from concurrent import futures  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from clipd import wire  # noqa: E402
from clipd.client import Client  # noqa: E402
from clipd.client import _client as client_internals  # noqa: E402
from clipd.client.updates import Layer, example_nbytes, iter_updates, rebatch  # noqa: E402
from clipd.server.settings import Settings  # noqa: E402
from clipd.v1 import clipd_pb2 as pb  # noqa: E402

MiB = 1 << 20
SUBMIT_METHOD = "/clipd.v1.Clipd/Submit"
# besides data_dir: defaults, but for warm_privacy (no private release here: the accountant is not loaded)
SERVER_SETTINGS = dict(host="127.0.0.1", grpc_port=0, admin_port=-1, warm_privacy=False)
SERVICES = ("durable", "memory")  # the real server: data_dir = a fresh directory, or "memory"
MEASURED = (*SERVICES, "bare")  # the order of even repeats; odd repeats reverse it


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layer_sizes: tuple[int, ...]  # float32 params per layer
    examples: int  # per timed measurement
    message_bytes: int  # the client's message size
    warmup_examples: int  # the untimed first submit

    @property
    def example_bytes(self) -> int:
        return 4 * sum(self.layer_sizes)


SMALL = (256,) * 4  # 1,024 params, 4 KB an example
LARGE = (131_072,) * 8  # 1,048,576 params, 4 MiB an example
FULL = (
    Case("small/1-per-msg", SMALL, 20_000, 4096, 64),
    Case("small/batched", SMALL, 400_000, 2 * MiB, 2048),
    Case("large", LARGE, 400, 2 * MiB, 4),
)
QUICK = (
    Case("small/1-per-msg", SMALL, 300, 4096, 8),
    Case("small/batched", SMALL, 4_000, 2 * MiB, 8),
    Case("large", LARGE, 32, 2 * MiB, 2),
)
GOAL_CASES = ("small/batched", "large")
PINGS_FULL, PINGS_QUICK = 100, 8  # back-to-back acknowledgement-latency batches per server
LATENCY_ROUNDS = 2  # each latency kind: this many streams per server, the servers' order alternating
LATENCY_WARMUP = 3  # untimed batches per server before the latency streams


# ----------------------------------------------------------------------------- the bare sink


def _sink_submit(request_iterator, context):
    """Reads the whole stream (parsed by the real deserializer), counting bytes; answers once."""
    nbytes = rows = messages = last = 0
    for request in request_iterator:
        messages += 1
        last = request.sequence
        for chunk in request.chunks:
            nbytes += len(chunk.data)
            if chunk.layer == 0 and chunk.offset == 0:
                rows += chunk.shape[0]
    context.set_trailing_metadata((("sink-bytes", str(nbytes)), ("sink-messages", str(messages))))
    yield pb.SubmitResponse(acknowledged_sequence=last, aggregation_examples=rows)


def create_sink(settings: Settings) -> tuple[grpc.Server, int]:
    """A grpc.server with the service's thread pool and options, answering only Submit."""
    options = [  # as clipd.server.app.ClipdServer builds them
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.max_streams + settings.unary_workers, thread_name_prefix="bare-sink"),
        options=options,
        maximum_concurrent_rpcs=settings.max_streams + settings.unary_workers,
    )
    handler = grpc.stream_stream_rpc_method_handler(
        _sink_submit,
        request_deserializer=pb.SubmitRequest.FromString,
        response_serializer=pb.SubmitResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("clipd.v1.Clipd", {"Submit": handler}),))
    port = server.add_insecure_port(f"{settings.host}:0")
    server.start()
    return server, port


# ----------------------------------------------------------------------------- servers


class InProcessServers:
    """The durable and the memory service and the bare sink, in this process."""

    def __init__(self, settings: dict[str, Settings]) -> None:
        from clipd.server.app import create_server

        self.services, self.ports = {}, {}
        try:
            for name in SERVICES:
                self.services[name], self.ports[name] = create_server(settings[name])
            self.sink, self.ports["bare"] = create_sink(settings["memory"])
        except BaseException:
            for service in self.services.values():
                service.stop(grace=1.0)
            raise

    def stop(self) -> None:
        self.sink.stop(grace=1.0).wait()
        for service in self.services.values():
            service.stop(grace=1.0)


def _child_servers(settings: dict[str, Settings], conn) -> None:
    servers = InProcessServers(settings)
    conn.send(servers.ports)
    conn.recv()  # until told to stop
    servers.stop()
    conn.send("stopped")


class ChildProcessServers:
    """All three servers in one child process (``--server-process``)."""

    def __init__(self, settings: dict[str, Settings]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(target=_child_servers, args=(settings, child_conn), daemon=True)
        self._process.start()
        try:
            self.ports = self._conn.recv()
        except EOFError:
            self._process.join(10)
            raise RuntimeError(f"the server process exited ({self._process.exitcode}) before serving") from None

    @property
    def pid(self) -> int:
        return self._process.pid

    def stop(self) -> None:
        self._conn.send("stop")
        self._conn.recv()
        self._process.join(10)


def filesystem_of(path: str) -> str:
    """``<type> on <device>`` of the mount holding ``path`` (from /proc/mounts), or ``?``."""
    path = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                device, mount, fstype = line.split()[:3]
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[0]):
                    best = (mount, fstype, device)
    except OSError:
        return "?"
    return f"{best[1]} on {best[2]}"


# ----------------------------------------------------------------------------- throughput


def make_data(case: Case, rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{k}": rng.standard_normal((rows, n), dtype=np.float32) for k, n in enumerate(case.layer_sizes)}


def median_norm(data: dict[str, np.ndarray], sample: int = 4096) -> float:
    squares = sum(np.einsum("ij,ij->i", a[:sample], a[:sample], dtype=np.float64) for a in data.values())
    return float(np.median(np.sqrt(squares)))


def encoded_requests(data, layers: Sequence[Layer], message_bytes: int) -> Iterator[pb.SubmitRequest]:
    """Exactly the SubmitRequests ``Client.submit`` would send for ``data``, built lazily by its own code."""
    encoder = client_internals._BatchStream("bare-sink", uuid.uuid4().hex, iter(()), message_bytes, 1 << 62)
    batches = rebatch(iter_updates(data, layers), example_nbytes(layers), message_bytes)
    for sequence, batch in enumerate(batches, 1):
        yield from encoder._encode(sequence, batch)


def wait_open(client: Client, aggregation_id: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get_aggregation(aggregation_id).state != pb.Aggregation.OPEN:
        if time.monotonic() > deadline:
            raise TimeoutError(f"aggregation {aggregation_id} did not open (compile) in {timeout} s")
        time.sleep(0.05)


@dataclasses.dataclass
class Result:
    case: Case
    seconds: dict[str, list[float]]  # per MEASURED name
    clip_fraction: dict[str, float]  # per SERVICES name

    def rate(self, which: str) -> float:
        return self.case.examples / statistics.median(self.seconds[which])

    @property
    def durable_vs_memory(self) -> float:
        return self.rate("durable") / self.rate("memory")

    @property
    def memory_vs_bare(self) -> float:
        """The ``service / bare`` ratio of earlier versions (which had no store)."""
        return self.rate("memory") / self.rate("bare")


def measure(case: Case, targets: dict[str, str], max_message_bytes: int, repeats: int, seed: int) -> Result:
    data = make_data(case, case.examples, seed)
    warm = {name: a[: case.warmup_examples] for name, a in data.items()}
    bound = median_norm(data)
    layers_spec = {name: (a.shape[1],) for name, a in data.items()}
    layers = [Layer(name, shape, "float32") for name, shape in layers_spec.items()]
    payload = case.examples * case.example_bytes

    with contextlib.ExitStack() as stack:
        clients = {
            name: stack.enter_context(Client(targets[name], message_bytes=case.message_bytes,
                                             max_message_bytes=max_message_bytes))
            for name in MEASURED
        }
        aggregations = {name: clients[name].create_aggregation(layers_spec, policy="global", l2_norm_clip=bound)
                        for name in SERVICES}
        for name in SERVICES:
            wait_open(clients[name], aggregations[name])
            clients[name].submit(aggregations[name], warm)  # untimed: first stream, first steps
        _bare_once(clients["bare"], warm, layers, case, case.warmup_examples)

        seconds: dict[str, list[float]] = {name: [] for name in MEASURED}
        for r in range(repeats):
            for which in (MEASURED if r % 2 == 0 else MEASURED[::-1]):
                if which == "bare":
                    seconds[which].append(_bare_once(clients[which], data, layers, case, case.examples))
                    continue
                start = time.perf_counter()
                report = clients[which].submit(aggregations[which], data)
                seconds[which].append(time.perf_counter() - start)
                if report.examples != case.examples or report.bytes != payload:
                    raise AssertionError(f"{case.name} ({which}): submit acknowledged {report.examples} examples, "
                                         f"{report.bytes} bytes; sent {case.examples}, {payload}")

        clip_fraction = {}
        for name in SERVICES:
            result = clients[name].finalize(aggregations[name])
            expected = case.warmup_examples + repeats * case.examples
            if result.examples != expected:
                raise AssertionError(f"{case.name} ({name}): the aggregation counted {result.examples} examples, "
                                     f"sent {expected}")
            clip_fraction[name] = result.clip_counts["layer0"] / result.examples
            clients[name].cancel(aggregations[name])
    return Result(case, seconds, clip_fraction)


def _serialize_request(request) -> bytes:
    """``SubmitRequest.SerializeToString``; a request the client's encoder already made bytes passes as is."""
    return request if isinstance(request, (bytes, bytearray, memoryview)) else request.SerializeToString()


def _raw_submit(client: Client):
    """A Submit multi-callable on ``client``'s channel (same options) that takes requests or bytes."""
    return client._channel.stream_stream(SUBMIT_METHOD, request_serializer=_serialize_request,
                                         response_deserializer=pb.SubmitResponse.FromString)


def _bare_once(sink: Client, data, layers: Sequence[Layer], case: Case, rows: int) -> float:
    submit = _raw_submit(sink)
    start = time.perf_counter()
    call = submit(encoded_requests(data, layers, case.message_bytes))
    responses = list(call)
    seconds = time.perf_counter() - start
    trailing = dict(call.trailing_metadata() or ())
    got_rows = responses[-1].aggregation_examples if responses else 0
    if got_rows != rows or int(trailing.get("sink-bytes", -1)) != rows * case.example_bytes:
        raise AssertionError(f"{case.name}: the bare sink got {got_rows} examples, "
                             f"{trailing.get('sink-bytes')} bytes; sent {rows}, {rows * case.example_bytes}")
    return seconds


# ----------------------------------------------------------------------------- acknowledgement latency


@dataclasses.dataclass
class Latency:
    pause: float  # seconds before each "after idle" batch
    back_to_back_ms: dict[str, list[float]]  # per SERVICES name
    idle_ms: dict[str, list[float]]


def ping_stream(client: Client, aggregation_id: str, batches: Sequence[list[np.ndarray]], pause: float,
                timeout: float = 60.0) -> list[float]:
    """One Submit stream that sends each batch only once the previous one is acknowledged.

    Returns, per batch, the milliseconds from handing its message to gRPC
    until the acknowledgement covering it arrived. ``pause``: seconds to wait
    before sending each batch. Uses a fresh client id (numbering from 1) and
    the client's own encoder; ``Client.submit`` is not used because it
    pipelines batches and only returns the total.
    """
    encoder = client_internals._BatchStream(aggregation_id, uuid.uuid4().hex, iter(()), client.message_bytes,
                                            1 << 62)
    messages = [encoder._encode(sequence, batch) for sequence, batch in enumerate(batches, 1)]  # before any clock
    hello = wire.submit_request(aggregation_id, encoder.client_id, 0, [], encoder.writer_id)
    cond = threading.Condition()
    progress = {"greeted": False, "acked": 0, "closed": False}
    sent_at = [math.nan] * len(batches)
    acked_at = [math.nan] * len(batches)

    def requests():
        yield hello
        with cond:
            if not cond.wait_for(lambda: progress["greeted"] or progress["closed"], timeout):
                return
        for k, batch_messages in enumerate(messages):
            if pause:
                time.sleep(pause)
            if progress["closed"]:
                return
            sent_at[k] = time.perf_counter()
            yield from batch_messages
            with cond:  # batch k has sequence k + 1
                if not cond.wait_for(lambda k=k: progress["acked"] > k or progress["closed"], timeout):
                    return

    call = _raw_submit(client)(requests())
    try:
        for response in call:
            now = time.perf_counter()
            with cond:
                if not progress["greeted"]:
                    if response.accepted_sequence != 0:
                        raise AssertionError(f"a fresh client id stands at {response.accepted_sequence}, not 0")
                    progress["greeted"] = True
                else:
                    for sequence in range(progress["acked"] + 1, response.acknowledged_sequence + 1):
                        acked_at[sequence - 1] = now
                    progress["acked"] = max(progress["acked"], response.acknowledged_sequence)
                cond.notify_all()
    finally:
        with cond:
            progress["closed"] = True
            cond.notify_all()
        call.cancel()
    if progress["acked"] != len(batches):
        raise AssertionError(f"latency stream: {progress['acked']} of {len(batches)} batches acknowledged")
    return [(acked - sent) * 1e3 for sent, acked in zip(sent_at, acked_at)]


def measure_ack_latency(targets: dict[str, str], max_message_bytes: int, pings: int, idle_pings: int,
                        pause: float, seed: int) -> Latency:
    rng = np.random.default_rng(seed)
    rows = 64
    arrays = [rng.standard_normal((rows, n), dtype=np.float32) for n in SMALL]
    layers_spec = {f"layer{k}": (n,) for k, n in enumerate(SMALL)}
    bound = median_norm(dict(zip(layers_spec, arrays)))
    counter = iter(range(1 << 62))

    def batches(n: int) -> list[list[np.ndarray]]:  # n batches of one example each
        return [[a[i % rows : i % rows + 1] for a in arrays] for i in (next(counter) for _ in range(n))]

    def split(total: int) -> list[int]:
        return [total // LATENCY_ROUNDS + (r < total % LATENCY_ROUNDS) for r in range(LATENCY_ROUNDS)]

    latency = Latency(pause, {name: [] for name in SERVICES}, {name: [] for name in SERVICES})
    sent = dict.fromkeys(SERVICES, 0)
    with contextlib.ExitStack() as stack:
        clients = {name: stack.enter_context(Client(targets[name], max_message_bytes=max_message_bytes))
                   for name in SERVICES}
        aggregations = {name: clients[name].create_aggregation(layers_spec, policy="global", l2_norm_clip=bound)
                        for name in SERVICES}
        for name in SERVICES:
            wait_open(clients[name], aggregations[name])
            ping_stream(clients[name], aggregations[name], batches(LATENCY_WARMUP), 0.0)  # untimed
            sent[name] += LATENCY_WARMUP
        kinds = ((latency.back_to_back_ms, split(pings), 0.0), (latency.idle_ms, split(idle_pings), pause))
        for out, counts, gap in kinds:
            for r, count in enumerate(counts):
                if not count:
                    continue
                for name in (SERVICES if r % 2 == 0 else SERVICES[::-1]):
                    first = 1 if not gap else 0  # back-to-back: the stream's first batch follows idle time
                    ms = ping_stream(clients[name], aggregations[name], batches(first + count), gap)
                    out[name].extend(ms[first:])
                    sent[name] += first + count
        for name in SERVICES:
            result = clients[name].finalize(aggregations[name])
            if result.examples != sent[name]:
                raise AssertionError(f"latency ({name}): the aggregation counted {result.examples} examples, "
                                     f"sent {sent[name]}")
            clients[name].cancel(aggregations[name])
    return latency


def _p90(values: Sequence[float]) -> float:
    return float(np.percentile(values, 90)) if values else math.nan


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


# ----------------------------------------------------------------------------- output

HEADER = (f"{'case':<16} {'examples':>9} {'B/example':>9} | {'durable ex/s':>12} {'GB/s':>6} | "
          f"{'memory ex/s':>12} {'GB/s':>6} | {'bare ex/s':>12} {'GB/s':>6} | {'dur/mem':>7} | {'mem/bare':>8}")


def print_row(r: Result) -> None:
    gb = r.case.example_bytes / 1e9
    rates = " | ".join(f"{r.rate(name):>12,.0f} {r.rate(name) * gb:>6.3f}" for name in MEASURED)
    print(f"{r.case.name:<16} {r.case.examples:>9} {r.case.example_bytes:>9} | {rates} | "
          f"{r.durable_vs_memory:>7.3f} | {r.memory_vs_bare:>8.3f}", flush=True)


def print_latency(latency: Latency) -> None:
    idle = f"after {latency.pause:.2f} s idle"
    header = (f"{'server':<16} | {'back-to-back':>12} {'median':>8} {'p90':>8} | "
              f"{idle:>18} {'median':>8} {'p90':>8}")
    print("acknowledgement latency, ms: one 1-example batch (4 KB, small model) at a time on one stream; "
          "clock: message handed to gRPC -> its acknowledgement")
    print(header)
    print("-" * len(header))
    for name in SERVICES:
        b2b, idle_ms = latency.back_to_back_ms[name], latency.idle_ms[name]
        print(f"{name:<16} | {len(b2b):>12} {_median(b2b):>8.2f} {_p90(b2b):>8.2f} | "
              f"{len(idle_ms):>18} {_median(idle_ms):>8.2f} {_p90(idle_ms):>8.2f}", flush=True)


def print_environment(settings: dict[str, Settings], cases: Sequence[Case], repeats: int, server_process: bool,
                      pings: int, idle_pings: int) -> None:
    import jax
    import jaxlib
    from google.protobuf.internal import api_implementation

    device = jax.devices()[0]
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    print(f"\nmachine: os.cpu_count()={os.cpu_count()}, usable CPUs={affinity}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"jax device: {device.platform} / {device.device_kind} ({jax.device_count()} device(s)); "
          f"python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
          f"grpcio {grpc.__version__}, protobuf {api_implementation.Type()}, numpy {np.__version__}")
    print("environment: " + ", ".join(f"{k}={os.environ.get(k, '')}" for k in (*TUNED, "XLA_FLAGS")))
    durable_dir = settings["durable"].data_dir
    same = {k: v for k, v in dataclasses.asdict(settings["durable"]).items() if k != "data_dir"}
    print(f"servers: {'one child process' if server_process else 'this process'}; sync gRPC API; "
          f"durable data_dir {durable_dir} ({filesystem_of(durable_dir)}), memory data_dir 'memory'; "
          f"otherwise the same Settings: {same}")
    window = inspect.signature(Client.__init__).parameters["window_bytes"].default
    print(f"client: window_bytes={window} (default), max_message_bytes={settings['memory'].max_message_bytes}; "
          f"message_bytes per case: " + ", ".join(f"{c.name}={c.message_bytes}" for c in cases))
    print(f"repeats: {repeats} (median shown), durable, memory and bare interleaved; global policy, "
          "bound = median example norm; warm-up submit per case: "
          + ", ".join(f"{c.name}={c.warmup_examples}" for c in cases))
    print(f"acknowledgement latency: {pings} back-to-back and {idle_pings} after-idle batches per server, "
          f"in {LATENCY_ROUNDS} rounds of streams alternating between the servers; {LATENCY_WARMUP} untimed first")


def main(argv: Sequence[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (< 30 s)")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per case (default 3, quick 1)")
    parser.add_argument("--server-process", action="store_true", help="run all servers in a child process")
    parser.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    parser.add_argument("--pings", type=int, default=None,
                        help=f"back-to-back acknowledgement-latency batches per server (default {PINGS_FULL}, "
                             f"quick {PINGS_QUICK}); half as many after idle; 0 skips the latency measurement")
    parser.add_argument("--durable-parent", default=None,
                        help="directory in which the durable server's fresh data_dir is made "
                             "(default: the system temp directory; it should be a local disk)")
    args = parser.parse_args(argv)
    cases = QUICK if args.quick else FULL
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = tuple(c for c in cases if c.name in wanted)
        if not cases:
            parser.error(f"--cases: choose among {[c.name for c in FULL]}")
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    pings = args.pings if args.pings is not None else (PINGS_QUICK if args.quick else PINGS_FULL)
    if pings < 0:
        parser.error("--pings must be >= 0")
    idle_pings = (pings + 1) // 2

    started = time.perf_counter()
    durable_dir = tempfile.mkdtemp(prefix="clipd-service-bench-", dir=args.durable_parent)
    settings = {
        "durable": Settings(**SERVER_SETTINGS, data_dir=durable_dir),
        "memory": Settings(**SERVER_SETTINGS, data_dir="memory"),
    }
    latency = None
    try:
        servers = (ChildProcessServers if args.server_process else InProcessServers)(settings)
        try:
            targets = {name: f"127.0.0.1:{port}" for name, port in servers.ports.items()}
            print(f"median of {repeats} repeat(s); GB/s = payload bytes (examples x B/example) / s / 1e9; "
                  "dur/mem = durable / memory examples/s; mem/bare = memory / bare examples/s "
                  "(the service / bare ratio of earlier runs)")
            print(HEADER)
            print("-" * len(HEADER), flush=True)
            results = []
            for i, case in enumerate(cases):
                result = measure(case, targets, settings["memory"].max_message_bytes, repeats, seed=i)
                results.append(result)
                print_row(result)
            if pings:
                print()
                latency = measure_ack_latency(targets, settings["memory"].max_message_bytes, pings, idle_pings,
                                              2 * settings["durable"].checkpoint_interval, seed=len(cases))
                print_latency(latency)
        finally:
            servers.stop()
    finally:
        shutil.rmtree(durable_dir, ignore_errors=True)

    print()
    for r in results:
        seconds = ", ".join(f"{name} s {[f'{s:.3f}' for s in r.seconds[name]]}" for name in MEASURED)
        clipped = "/".join(f"{r.clip_fraction[name]:.2f}" for name in SERVICES)
        print(f"{r.case.name}: {seconds}, clip fraction {clipped} (durable/memory)")
    print_environment(settings, cases, repeats, args.server_process, pings, idle_pings)
    by_name = {r.case.name: r for r in results}
    goals = [name for name in GOAL_CASES if name in by_name]
    durable_ratio = min((by_name[n].durable_vs_memory for n in goals), default=math.nan)
    ratio = min((by_name[n].memory_vs_bare for n in goals), default=math.nan)
    if goals:
        print(f"goals: dur/mem >= 0.9 in small/batched and large "
              f"({', '.join(f'{n} {by_name[n].durable_vs_memory:.3f}' for n in goals)}); "
              f"mem/bare >= 0.85 in both ({', '.join(f'{n} {by_name[n].memory_vs_bare:.3f}' for n in goals)})")
    if "small/batched" in by_name:
        r = by_name["small/batched"]
        print(f"goals: small/batched >= 200,000 examples/s (durable {r.rate('durable'):,.0f}, "
              f"memory {r.rate('memory'):,.0f})")
    if latency is not None:
        print("median acknowledgement latency: " + "; ".join(
            f"{name} {_median(latency.back_to_back_ms[name]):.2f} ms back-to-back, "
            f"{_median(latency.idle_ms[name]):.2f} ms after idle" for name in SERVICES))
    print(f"total time {time.perf_counter() - started:.0f} s")
    print(f"durable_vs_memory_ratio={durable_ratio:.3f}")
    print(f"service_vs_bare_grpc_ratio={ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()
