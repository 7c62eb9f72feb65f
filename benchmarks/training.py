"""What a DP-SGD step costs through clipd, against the same step done locally by Opacus.

The model, data and step of ``examples/dpsgd_torch.py`` (an MLP of 2,410 parameters on
scikit-learn's digits, Poisson sampling with an expected batch of ``--batch-size``), ``--steps`` steps
after ``--warmup`` (compilation), medians:

- ``opacus``: Opacus 1.6 does the whole step in the trainer's process: per-sample gradients
  (GradSampleModule hooks), flat clipping, Gaussian noise, the RDP accountant's step, SGD.
- ``clipd``: per-sample gradients with ``torch.func`` in the trainer; clipping, noise and accounting
  by a real `clipd serve` process on loopback (its durable SQLite store in a temporary directory,
  or ``--store memory``) through ``DpSgd``: each step one call (``Step``, the default), or the
  separate calls (create, submit, finalize, cancel) pipelined (the next step's aggregation created and
  the last one dropped while the trainer computes) and sequential (every call in turn).
- ``grads``: the trainer's own part of a clipd step (sampling, ``torch.func`` per-example gradients,
  SGD), measured alone: ``clipd - grads`` is what the service adds.
- ``floor``: the trainer's part plus one round trip of a bare gRPC server (a process of its own
  that reads the request and answers as many bytes as a step's release) carrying a step's request
  at the expected batch (its per-example gradients: ``batch-size`` x 2,410 float32): what no
  service on this path can go under.

The first step of each, apart: Opacus' (its hooks' first run) and the one-call trainer's, which is the
served ``clipd serve``'s first Step (started while this process imports torch: its privacy accountant
loaded by then, as a server started before its trainer has it), with what its shapes compile.

Then where a step's time goes inside the server: the same one-call steps against a server in this
process, its create, the gradients' clip and sum, the release's noise, the ledger's epsilon and the
store's commits, timed by wrapping those functions; and the separate calls' client-side phases. The last line:
``training: opacus_ms=<a> clipd_ms=<b> grads_ms=<c> overhead_ms=<b-a> service_ms=<b-c> floor_ms=<f>
vs_opacus=<b/a> vs_floor=<b/f>`` (``clipd_ms``: the default, one call).

Run: ``python benchmarks/training.py`` (``--quick`` for a smoke run). Needs torch, opacus, scikit-learn.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import logging
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
from scale import stop_process  # benchmarks/scale.py (benchmarks/ is this script's directory)

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))


def median_ms(values) -> float:
    return 1e3 * statistics.median(values) if values else 0.0


def opacus_steps(data, args) -> tuple[list[float], float]:
    """Seconds per step of Opacus doing it all locally (its DataLoader's Poisson sampling replaced by
    the same sampling as clipd's trainer, so that both steps see the same batches), and of its first step."""
    import torch
    from dpsgd_torch import Mlp
    from opacus import GradSampleModule
    from opacus.accountants import RDPAccountant
    from opacus.optimizers import DPOptimizer

    from clipd.client.dpsgd import poisson_sample

    torch.manual_seed(0)
    n = len(data.y_train)
    q = args.batch_size / n
    model = GradSampleModule(Mlp())
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), noise_multiplier=args.z,
                            max_grad_norm=1.0, expected_batch_size=int(args.batch_size))
    accountant = RDPAccountant()
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    rng, times = np.random.default_rng(1), []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        batch = torch.from_numpy(poisson_sample(n, q, rng))
        optimizer.zero_grad()
        with warnings.catch_warnings():  # torch notes that the input needs no gradient: it doesn't
            warnings.simplefilter("ignore", UserWarning)
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
        accountant.step(noise_multiplier=args.z, sample_rate=q)
        if step == 0:
            first = time.perf_counter() - started
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    return times, first


def clipd_steps(data, args, client, pipeline: bool = True, grads_only: bool = False, warm=lambda: None,
                one_call: bool = True):
    """Seconds per step through clipd (or of the trainer's part alone), and the seconds of each call."""
    import torch
    from dpsgd_torch import Mlp, per_example_gradients

    from clipd.client.dpsgd import DpSgd, poisson_sample

    torch.manual_seed(0)
    n = len(data.y_train)
    model = Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    layers = {name: tuple(p.shape) for name, p in model.named_parameters()}
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    rng, times, phases = np.random.default_rng(1), [], collections.defaultdict(list)
    with DpSgd(client, layers, l2_norm_clip=1.0, noise_multiplier=args.z, sampling_rate=args.batch_size / n,
               dataset_size=n, delta=1e-5, pipeline=pipeline, one_call=one_call) as dp:
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                warm()
            started = time.perf_counter()
            batch = torch.from_numpy(poisson_sample(n, dp.sampling_rate, rng))
            grads = per_example_gradients(model, x[batch], y[batch])
            if grads_only:  # the same update with the plain mean (what the trainer itself computes)
                gradient = {k: g.mean(0).numpy() for k, g in grads.items()}
            else:
                result = dp.step(grads)
                gradient = result.gradient
            for name, p in model.named_parameters():
                p.grad = torch.from_numpy(gradient[name])
            optimizer.step()
            if step == 0:
                phases["first"].append(time.perf_counter() - started)
            if step >= args.warmup:
                times.append(time.perf_counter() - started)
                if not grads_only:
                    for phase, seconds in result.seconds.items():
                        phases[phase].append(seconds)
    return times, phases


@contextlib.contextmanager
def clipd_serve(data_dir: str):
    """``clipd serve`` on a free loopback port, in a process of its own (as a trainer would reach it), with its
    default settings (``max_device_rows`` 4,096: a step's programs as a plain ``clipd serve`` runs them): yields
    a function that waits until it listens and returns its address."""
    server = subprocess.Popen([sys.executable, "-m", "clipd", "serve", "--grpc-port", "0", "--admin-port", "-1",
                               "--data-dir", data_dir, "--log-level", "warning"],
                              stdout=subprocess.PIPE, text=True)
    @functools.cache
    def target() -> str:  # waits (once) for "clipd serving gRPC on 127.0.0.1:PORT": listening
        line = server.stdout.readline()
        if "serving" not in line:
            raise RuntimeError(f"clipd serve did not start: {line!r}")
        return line.split(" on ")[1].split(",")[0].strip()

    try:
        yield target
    finally:
        stop_process(server)


def bare_sink(answer_bytes: int) -> None:
    """A plain gRPC server (this process): one unary method that takes any request and answers ``answer_bytes``
    bytes; prints its port, serves until killed."""
    from concurrent import futures

    import grpc

    answer = bytes(answer_bytes)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bare.Sink", {
        "Step": grpc.unary_unary_rpc_method_handler(lambda request, context: answer)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def bare_round_trips(request_bytes: int, answer_bytes: int, calls: int) -> list[float]:
    """Seconds of each of ``calls`` round trips to a bare sink in a process of its own (after 5 unmeasured)."""
    import grpc

    sink = subprocess.Popen([sys.executable, __file__, "--bare-sink", str(answer_bytes)], stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(sink.stdout.readline())
        request = bytes(request_bytes)
        with grpc.insecure_channel(f"127.0.0.1:{port}",
                                   options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            call = channel.unary_unary("/bare.Sink/Step")
            times = []
            for k in range(5 + calls):
                started = time.perf_counter()
                call(request, timeout=60)
                if k >= 5:
                    times.append(time.perf_counter() - started)
        return times
    finally:
        stop_process(sink)


@contextlib.contextmanager
def server_timers():
    """Wraps the embedded server's create, clip and sum, noise, epsilon and commits with timers."""
    from clipd.engine import _privacy as dp
    from clipd.server import lifecycle, privacy
    from clipd.server.rpc import steps
    from clipd.server.stores import sqlite as sqlite_store
    from clipd.server.summing import inline

    timers = collections.defaultdict(list)
    originals = []

    def wrap(owner, name, label):
        original = getattr(owner, name)
        originals.append((owner, name, original))

        def timed(*a, **k):
            started = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                timers[label].append(time.perf_counter() - started)

        setattr(owner, name, timed)

    wrap(steps, "step", "the step, whole (in the server)")
    wrap(lifecycle.Lifecycle, "create", "create (the ledger's reservation)")
    wrap(inline, "sum_batch", "clip and sum the gradients (in line)")
    wrap(sqlite_store.SQLiteStore, "save_checkpoint", "checkpoints")
    wrap(dp, "add_gaussian_noise", "noise")
    wrap(dp, "epsilon_of_json", "ledger epsilon (each create and release)")
    wrap(sqlite_store.SQLiteStore, "commit_release", "the commit (record, release, ledger entry, step before gone)")
    wrap(privacy.Ledgers, "release", "release (noise + epsilon + the commit)")
    wrap(sqlite_store.SQLiteStore, "delete", "deletes apart from the commit")
    try:
        yield timers
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=float, default=256.0)
    parser.add_argument("--z", type=float, default=2.0)
    parser.add_argument("--store", choices=["durable", "memory"], default="durable")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--bare-sink", type=int, default=0, help=argparse.SUPPRESS)  # (the floor's server)
    args = parser.parse_args()
    if args.bare_sink:
        bare_sink(args.bare_sink)
        return
    if args.quick:
        args.steps, args.warmup = 6, 2  # and no in-process breakdown of the server's part
    logging.getLogger("absl").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as workdir:
        def store(name):
            return os.path.join(workdir, name) if args.store == "durable" else "memory"

        # The server process starts while this one imports torch and Opacus (waited for before any timing).
        with clipd_serve(store("served")) as served:
            import torch

            torch.set_num_threads(1)  # the trainer and the server share the machine's cores, as in the example
            from dpsgd_common import load_digits

            from clipd.client import Client
            from clipd.server.app import create_server
            from clipd.server.settings import Settings

            data = load_digits()
            print(f"DP-SGD step, MLP of 2,410 parameters, expected batch {args.batch_size:g} of"
                  f" {len(data.y_train)}, z = {args.z:g}; {args.steps} steps after {args.warmup};"
                  f" clipd store: {args.store}")
            target = served()
            opacus, opacus_first = opacus_steps(data, args)
            with Client(target) as client:  # a server process of its own
                grads, _ = clipd_steps(data, args, client, grads_only=True)
                one_call, one_call_phases = clipd_steps(data, args, client)  # the server's first Step
                pipelined, pipelined_phases = clipd_steps(data, args, client, one_call=False)
                sequential, phases = clipd_steps(data, args, client, pipeline=False, one_call=False)
        parameters = 2_410
        request = int(args.batch_size) * parameters * 4 + 1_024  # the gradients, and the step's spec
        rtt = bare_round_trips(request, parameters * 4 + 1_024, args.steps)
        timers: dict = {}
        if not args.quick:  # where the time goes inside: the same one-call steps, a server in this process
            server, port = create_server(Settings(host="127.0.0.1", grpc_port=0, admin_port=-1,
                                                  data_dir=store("embedded")))
            try:
                with Client(f"127.0.0.1:{port}") as client, server_timers() as timers:
                    clipd_steps(data, args, client, warm=timers.clear)
            finally:
                server.stop(grace=1.0)

    base, grads_ms, rtt_ms = median_ms(opacus), median_ms(grads), median_ms(rtt)
    floor_ms = grads_ms + rtt_ms
    print()
    print(f"{'step':<40} | {'ms/step':>8} | {'vs opacus':>9} | {'vs floor':>8}")
    for name, ms in (("opacus (all local)", base), ("trainer's part alone (grads, SGD)", grads_ms),
                     ("floor: trainer's part + bare round trip", floor_ms),
                     ("clipd, one call (default)", median_ms(one_call)),
                     ("clipd, separate calls, pipelined", median_ms(pipelined)),
                     ("clipd, separate calls, sequential", median_ms(sequential))):
        print(f"{name:<40} | {ms:>8.2f} | {ms / base:>9.2f} | {ms / floor_ms:>8.2f}")
    print(f"first step: clipd, one call, a server's first Step {1e3 * one_call_phases['first'][0]:.0f} ms;"
          f" Opacus {1e3 * opacus_first:.0f} ms (each with what it compiles or loads for its first step)")
    print(f"bare gRPC round trip of a step's bytes ({request:,} up, {parameters * 4 + 1_024:,} back): {rtt_ms:.2f} ms")
    print(f"pipelined separate calls, median ms: waiting for the aggregation made ahead"
          f" {median_ms(pipelined_phases['create']):.2f}, submit {median_ms(pipelined_phases['submit']):.2f},"
          f" finalize {median_ms(pipelined_phases['finalize']):.2f}")
    print()
    print(f"{'where a step goes':<58} | {'median ms':>9}")
    for phase in ("create", "submit", "finalize", "cancel"):
        label = {"submit": "submit (until acknowledged)", "finalize": "finalize (with the release)"}.get(phase, phase)
        print(f"{'separate calls, sequential, client: ' + label:<58} | {median_ms(phases[phase]):>9.2f}")
    for label, values in timers.items():
        per_step = sum(values) / args.steps
        print(f"{'one call, server in-process, per step: ' + label:<58} | {per_step * 1e3:>9.2f}")
    clipd_ms = median_ms(one_call)
    print(f"training: opacus_ms={base:.2f} clipd_ms={clipd_ms:.2f} grads_ms={grads_ms:.2f}"
          f" overhead_ms={clipd_ms - base:.2f} service_ms={clipd_ms - grads_ms:.2f} floor_ms={floor_ms:.2f}"
          f" vs_opacus={clipd_ms / base:.2f} vs_floor={clipd_ms / floor_ms:.2f}")


if __name__ == "__main__":
    main()
