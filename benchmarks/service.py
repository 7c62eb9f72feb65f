"""Service benchmark: the real clipd service end to end on loopback, against a bare gRPC sink.

What is measured, for every case (random normal float32 examples, drawn once
before any timing; global L2 bound = the median example norm, so about half
the examples are clipped):

  small/1-per-msg  1,024 params in 4 layers (4 KB an example), one example per
                   message (``Client(message_bytes=4096)``): per-message cost;
  small/batched    the same model, ~2 MiB messages (512 examples each, the
                   client's default ``message_bytes``);
  large            1,048,576 params in 8 layers (4 MiB an example), each
                   example split into two ~2 MiB messages.

service  ``Client.submit(aggregation, {name: (N, *shape)})`` against the real
         server (``create_server``): the clock runs from the call to its return,
         i.e. until the server has acknowledged every batch as summed. It so
         includes the client's batching and encoding, gRPC, the server's
         decoding, validation, reassembly, queueing, the copy into the
         staging buffer, the jitted clip-and-sum steps and the acknowledgements.
         Warm-up is excluded: the aggregation is created, polled until OPEN
         (every bucket compiled) and fed a small untimed submit first. All
         repeats of a case go into one aggregation (each with its own client
         id); it is then finalized and its example count checked.

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

So both sides pay the same client-side work and the same wire; the ratio
``service / bare`` is what the service loses to its own work (decode,
validate, copy, device step, acknowledgements and flow control) relative to
gRPC just moving the same bytes. Client and server run in this one process by
default, as a user's in-process test would (they share the GIL and the 2
cores); ``--server-process`` runs both servers in a child process instead.

Service and bare measurements are interleaved (their order alternates), each
``--repeats`` times (default 3); the table shows medians. GB/s counts payload
bytes (examples x bytes per example) per second, 1 GB = 1e9 bytes.

The run needs glibc's malloc kept from returning big buffers to the OS and
single-threaded OpenBLAS (see shared/DESIGN.md, "Measured on these machines"):
the script re-executes itself with ``MALLOC_MMAP_THRESHOLD_=33554432``,
``MALLOC_TRIM_THRESHOLD_=1073741824`` and ``OPENBLAS_NUM_THREADS=1`` when they
are not already set to those values. It uses the sync gRPC API throughout.

The last line is ``service_vs_bare_grpc_ratio=<x>``: the smaller of the
small/batched and large ratios (the issue asks for >= 0.85 in both, and
>= 200,000 examples/s for small/batched).

Run:  python benchmarks/service.py                    (full run, ~2-3 minutes on 2 cores)
      python benchmarks/service.py --server-process   (servers in a child process)
      python benchmarks/service.py --quick            (tiny smoke run, < 30 s)
"""

from __future__ import annotations

import os
import sys

# Must be in the environment before the process starts (glibc reads them at start-up).
REQUIRED_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "1073741824",
    "OPENBLAS_NUM_THREADS": "1",
}
_REEXEC_MARK = "CLIPD_SERVICE_BENCH_REEXEC"

if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in REQUIRED_ENV.items()):
    if os.environ.get(_REEXEC_MARK):
        sys.exit("benchmarks/service.py: could not set " + ", ".join(REQUIRED_ENV) + " by re-executing")
    _env = {**os.environ, **REQUIRED_ENV, _REEXEC_MARK: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], _env)

import argparse  # noqa: E402  (after the re-exec on purpose: nothing heavy is loaded twice)
import dataclasses  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from concurrent import futures  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from clipd.client import Client  # noqa: E402
from clipd.client import _client as client_internals  # noqa: E402
from clipd.client.updates import Layer, example_nbytes, iter_updates, rebatch  # noqa: E402
from clipd.server.settings import Settings  # noqa: E402
from clipd.v1 import clipd_pb2 as pb  # noqa: E402

MiB = 1 << 20
SUBMIT_METHOD = "/clipd.v1.Clipd/Submit"
SERVER_SETTINGS = dict(host="127.0.0.1", grpc_port=0, admin_port=-1)  # everything else: defaults


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
        futures.ThreadPoolExecutor(max_workers=settings.workers, thread_name_prefix="bare-sink"),
        options=options,
        maximum_concurrent_rpcs=settings.workers,
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
    """The real service and the bare sink, in this process."""

    def __init__(self, settings: Settings) -> None:
        from clipd.server.app import create_server

        self.service, self.service_port = create_server(settings)
        self.sink, self.sink_port = create_sink(settings)

    def stop(self) -> None:
        self.sink.stop(grace=1.0).wait()
        self.service.stop(grace=1.0)


def _child_servers(settings: Settings, conn) -> None:
    servers = InProcessServers(settings)
    conn.send((servers.service_port, servers.sink_port))
    conn.recv()  # until told to stop
    servers.stop()
    conn.send("stopped")


class ChildProcessServers:
    """The real service and the bare sink, both in one child process (``--server-process``)."""

    def __init__(self, settings: Settings) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(target=_child_servers, args=(settings, child_conn), daemon=True)
        self._process.start()
        self.service_port, self.sink_port = self._conn.recv()

    @property
    def pid(self) -> int:
        return self._process.pid

    def stop(self) -> None:
        self._conn.send("stop")
        self._conn.recv()
        self._process.join(10)


# ----------------------------------------------------------------------------- measurements


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
    service_s: list[float]
    bare_s: list[float]
    clip_fraction: float

    def rate(self, seconds: list[float]) -> float:
        return self.case.examples / statistics.median(seconds)

    @property
    def service_rate(self) -> float:
        return self.rate(self.service_s)

    @property
    def bare_rate(self) -> float:
        return self.rate(self.bare_s)

    @property
    def ratio(self) -> float:
        return self.service_rate / self.bare_rate


def measure(case: Case, service_target: str, sink_target: str, max_message_bytes: int, repeats: int,
            seed: int) -> Result:
    data = make_data(case, case.examples, seed)
    warm = {name: a[: case.warmup_examples] for name, a in data.items()}
    bound = median_norm(data)
    layers_spec = {name: (a.shape[1],) for name, a in data.items()}
    layers = [Layer(name, shape, "float32") for name, shape in layers_spec.items()]
    payload = case.examples * case.example_bytes

    with Client(service_target, message_bytes=case.message_bytes, max_message_bytes=max_message_bytes) as service, \
            Client(sink_target, message_bytes=case.message_bytes, max_message_bytes=max_message_bytes) as sink:
        aggregation = service.create_aggregation(layers_spec, policy="global", l2_norm_clip=bound)
        wait_open(service, aggregation)
        service.submit(aggregation, warm)  # untimed: first stream, first steps
        _bare_once(sink, warm, layers, case, case.warmup_examples)

        service_s, bare_s = [], []
        for r in range(repeats):
            order = ("service", "bare") if r % 2 == 0 else ("bare", "service")
            for which in order:
                if which == "service":
                    start = time.perf_counter()
                    report = service.submit(aggregation, data)
                    service_s.append(time.perf_counter() - start)
                    if report.examples != case.examples or report.bytes != payload:
                        raise AssertionError(f"{case.name}: submit acknowledged {report.examples} examples, "
                                             f"{report.bytes} bytes; sent {case.examples}, {payload}")
                else:
                    bare_s.append(_bare_once(sink, data, layers, case, case.examples))

        result = service.finalize(aggregation)
        expected = case.warmup_examples + repeats * case.examples
        if result.examples != expected:
            raise AssertionError(f"{case.name}: the aggregation counted {result.examples} examples, sent {expected}")
        clip_fraction = result.clip_counts["layer0"] / result.examples
        service.cancel(aggregation)
    return Result(case, service_s, bare_s, clip_fraction)


def _serialize_request(request) -> bytes:
    """``SubmitRequest.SerializeToString``; a request the client's encoder already made bytes passes as is."""
    return request if isinstance(request, (bytes, bytearray, memoryview)) else request.SerializeToString()


def _bare_once(sink: Client, data, layers: Sequence[Layer], case: Case, rows: int) -> float:
    submit = sink._channel.stream_stream(SUBMIT_METHOD, request_serializer=_serialize_request,
                                         response_deserializer=pb.SubmitResponse.FromString)
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


# ----------------------------------------------------------------------------- output

HEADER = (f"{'case':<16} {'examples':>9} {'B/example':>9} | {'service ex/s':>12} {'GB/s':>6} | "
          f"{'bare ex/s':>12} {'GB/s':>6} | {'ratio':>6}")


def print_row(r: Result) -> None:
    gb = r.case.example_bytes / 1e9
    print(f"{r.case.name:<16} {r.case.examples:>9} {r.case.example_bytes:>9} | {r.service_rate:>12,.0f} "
          f"{r.service_rate * gb:>6.3f} | {r.bare_rate:>12,.0f} {r.bare_rate * gb:>6.3f} | {r.ratio:>6.3f}",
          flush=True)


def print_environment(settings: Settings, cases: Sequence[Case], repeats: int, server_process: bool) -> None:
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
    print("environment: " + ", ".join(f"{k}={os.environ.get(k, '')}" for k in (*REQUIRED_ENV, "XLA_FLAGS")))
    print(f"servers: {'a child process' if server_process else 'this process'}; sync gRPC API; "
          f"server Settings: {dataclasses.asdict(settings)}")
    window = inspect.signature(Client.__init__).parameters["window_bytes"].default
    print(f"client: window_bytes={window} (default), max_message_bytes={settings.max_message_bytes}; "
          f"message_bytes per case: " + ", ".join(f"{c.name}={c.message_bytes}" for c in cases))
    print(f"repeats: {repeats} (median shown), service and bare interleaved; global policy, bound = median "
          "example norm; warm-up submit per case: " + ", ".join(f"{c.name}={c.warmup_examples}" for c in cases))


def main(argv: Sequence[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (< 30 s)")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per case (default 3, quick 1)")
    parser.add_argument("--server-process", action="store_true", help="run both servers in a child process")
    parser.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
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

    settings = Settings(**SERVER_SETTINGS)
    started = time.perf_counter()
    servers = ChildProcessServers(settings) if args.server_process else InProcessServers(settings)
    try:
        service_target = f"127.0.0.1:{servers.service_port}"
        sink_target = f"127.0.0.1:{servers.sink_port}"
        print(f"median of {repeats} repeat(s); GB/s = payload bytes (examples x B/example) / s / 1e9; "
              "ratio = service / bare examples/s")
        print(HEADER)
        print("-" * len(HEADER), flush=True)
        results = []
        for i, case in enumerate(cases):
            result = measure(case, service_target, sink_target, settings.max_message_bytes, repeats, seed=i)
            results.append(result)
            print_row(result)
    finally:
        servers.stop()

    print()
    for r in results:
        print(f"{r.case.name}: service s {['%.3f' % s for s in r.service_s]}, bare s "
              f"{['%.3f' % s for s in r.bare_s]}, clip fraction {r.clip_fraction:.2f}")
    print_environment(settings, cases, repeats, args.server_process)
    by_name = {r.case.name: r for r in results}
    goals = [name for name in ("small/batched", "large") if name in by_name]
    ratio = min((by_name[n].ratio for n in goals), default=math.nan)
    if "small/batched" in by_name:
        rate = by_name["small/batched"].service_rate
        print(f"goals: ratio >= 0.85 in small/batched and large ({', '.join(f'{n} {by_name[n].ratio:.3f}' for n in goals)}); "
              f"small/batched >= 200,000 examples/s ({rate:,.0f})")
    print(f"total time {time.perf_counter() - started:.0f} s")
    print(f"service_vs_bare_grpc_ratio={ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()
