"""Correlated noise (DP-FTRL) against independent noise: utility at the same epsilon, and what a release costs.

**Utility** (``--utility``, the default): ``examples/dpsgd_torch.py`` on scikit-learn's digits, 6 epochs of
6 steps (expected batch 256), flat clipping C = 1, each configuration at the same epsilon (delta 1e-5) and
with several model seeds (the noise is secret, so the seeds spread the runs); the mean and spread of the
final test accuracy:

  blt            one BLT stream for the 36 steps, each example in one shuffled batch of every epoch
                 (b = 6, k = 6, declared), z = ``--z``: the whole run is one Gaussian mechanism of z.
  independent    the same batches and participation, independent noise per step (a banded strategy of
                 one band: C = I; its sensitivity under (b, k) is sqrt(k)), the same z: the same epsilon.
  poisson        independent noise on Poisson samples of rate 256/1,438, amplified by sampling (dp_accounting's
                 RDP, as the examples' default), with z calibrated here to the same epsilon.

**Cost** (``--cost``): one release of a model of ``--parameters`` (default 10^6 and 10^7) float32
parameters on a real server with a durable (SQLite) store, independent noise against a BLT stream of
``--buffers`` buffers: Finalize's time (noise, the stream's state and the release committed), medians of
``--repeats``, and the state the stream keeps in the store.

The last lines: ``utility: blt=<mean> independent=<mean> poisson=<mean> epsilon=<e>`` and
``cost: params=<p> independent_s=<t> blt_s=<t> ratio=<r> state_bytes=<s>`` per size.

    python benchmarks/dpftrl.py                 # utility and cost (about 10 minutes on 2 cores)
    python benchmarks/dpftrl.py --quick         # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _epsilon_of_one_gaussian(z: float, delta: float) -> float:
    from dp_accounting import dp_event as dpe
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dpe.GaussianDpEvent(z), 1)
    return accountant.get_epsilon(delta)


def _poisson_z(epsilon: float, delta: float, rate: float, steps: int) -> float:
    import dp_accounting
    from dp_accounting import dp_event as dpe
    from dp_accounting.rdp import rdp_privacy_accountant

    return float(dp_accounting.calibrate_dp_mechanism(
        rdp_privacy_accountant.RdpAccountant,
        lambda z: dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(rate, dpe.GaussianDpEvent(z)), steps),
        epsilon, delta))


def _run_example(flags: list[str], seed: int, epochs: int) -> dict:
    out = tempfile.mkdtemp(prefix="clipd-dpftrl-")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "dpsgd_torch.py"), "--quiet", "--no-plot",
                           "--epochs", str(epochs), "--seed", str(seed), "--out", out, *flags],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"dpsgd_torch.py {flags} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads((pathlib.Path(out) / "dpsgd_torch.json").read_text())


def utility(z: float, seeds: int, epochs: int) -> None:
    delta, n, batch = 1e-5, 1438, 256.0
    epsilon = _epsilon_of_one_gaussian(z, delta)
    steps = epochs * max(1, round(n / batch))
    z_poisson = _poisson_z(epsilon, delta, batch / n, steps)
    configs = {
        "blt": ["--mechanism", "blt", "--noise-multiplier", str(z)],
        "independent": ["--mechanism", "banded", "--buffers", "1", "--noise-multiplier", str(z)],
        "poisson": ["--mechanism", "independent", "--noise-multiplier", f"{z_poisson:.6f}",
                    "--metrics-noise-multiplier", "0"],
    }
    accuracies: dict[str, list[float]] = {name: [] for name in configs}
    epsilons: dict[str, list[float]] = {name: [] for name in configs}
    for seed in range(seeds):
        for name, flags in configs.items():  # interleaved: a drift of the machine hits every configuration
            summary = _run_example(flags, seed, epochs)
            accuracies[name].append(summary["accuracy"])
            epsilons[name].append(summary["epsilon"])
    print(f"utility: digits, {epochs} epochs of {steps // epochs} steps, C = 1, delta {delta:g}, {seeds} seeds each")
    print(f"{'configuration':<14}| {'z':>7} | {'epsilon':>8} | {'accuracy mean':>13} | {'min':>6} | {'max':>6}")
    print("-" * 66)
    for name in configs:
        zs = z_poisson if name == "poisson" else z
        acc = accuracies[name]
        print(f"{name:<14}| {zs:7.4f} | {statistics.median(epsilons[name]):8.4f} | {statistics.mean(acc):13.4f} |"
              f" {min(acc):6.4f} | {max(acc):6.4f}")
    print(f"utility: blt={statistics.mean(accuracies['blt']):.4f}"
          f" independent={statistics.mean(accuracies['independent']):.4f}"
          f" poisson={statistics.mean(accuracies['poisson']):.4f} epsilon={epsilon:.4f}")


def cost(sizes: list[int], buffers: int, repeats: int) -> None:
    from clipd.client import Client, Privacy
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    data_dir = tempfile.mkdtemp(prefix="clipd-dpftrl-cost-")
    server, port = create_server(Settings(host="127.0.0.1", grpc_port=0, admin_port=-1, data_dir=data_dir))
    rows = []
    try:
        with Client(f"127.0.0.1:{port}") as client:
            for parameters in sizes:
                layers = {"w": (parameters,)}
                update = {"w": (np.random.default_rng(0).standard_normal(parameters) * 1e-4).astype(np.float32)}
                times: dict[str, list[float]] = {"independent": [], "blt": []}
                ledgers = {"independent": Privacy(f"ind-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=1.0),
                           "blt": Privacy(f"blt-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=1.0,
                                          mechanism="blt", releases=repeats + 1, buffers=buffers,
                                          min_separation=1, max_participations=repeats + 1)}
                for k in range(repeats + 1):  # the first of each: warm-up (compilation, the strategy)
                    for name, privacy in ledgers.items():
                        aggregation = client.create_aggregation(layers, l2_norm_clip=1.0, privacy=privacy)
                        client.submit(aggregation, update, client_id=f"c{k}")
                        started = time.perf_counter()
                        client.finalize(aggregation)
                        if k:
                            times[name].append(time.perf_counter() - started)
                        client.cancel(aggregation)
                state = client.ledger(ledgers["blt"].ledger_id).stream_state_bytes
                rows.append((parameters, statistics.median(times["independent"]), statistics.median(times["blt"]),
                             state))
    finally:
        server.stop(grace=1.0)
    print(f"cost: one release on a durable (SQLite) store, BLT with {buffers} buffers, medians of {repeats}")
    print(f"{'parameters':>11} | {'independent s':>13} | {'blt s':>7} | {'blt/ind':>7} | {'state MB':>8}")
    print("-" * 58)
    for parameters, independent, blt, state in rows:
        print(f"{parameters:>11,} | {independent:13.3f} | {blt:7.3f} | {blt / independent:7.2f} | {state / 1e6:8.1f}")
    for parameters, independent, blt, state in rows:
        print(f"cost: params={parameters} independent_s={independent:.4f} blt_s={blt:.4f}"
              f" ratio={blt / independent:.3f} state_bytes={state}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utility", action="store_true", help="only the utility runs")
    parser.add_argument("--cost", action="store_true", help="only the release cost")
    parser.add_argument("--z", type=float, default=2.0, help="the correlated runs' noise multiplier")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--parameters", type=int, nargs="+", default=[10**6, 10**7])
    parser.add_argument("--buffers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 seed, 1 epoch, 10^4 parameters")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.quick:
        args.seeds, args.epochs, args.parameters, args.repeats, args.buffers = 1, 1, [10**4], 1, 1
    both = not (args.utility or args.cost)
    if args.utility or both:
        utility(args.z, args.seeds, args.epochs)
    if args.cost or both:
        cost(args.parameters, args.buffers, args.repeats)


if __name__ == "__main__":
    main()
