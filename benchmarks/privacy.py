"""Privacy benchmark: what a private release costs at Finalize, and accounting against ledger length.

Two tables, medians of ``--repeats`` runs, each with a reference measured in the same run:

1. Finalize latency of an aggregation of P float32 parameters (one layer, 8
   examples in it) on the real server (durable store in a temp directory):
   ``plain`` (no privacy policy: the clipped sum is committed and returned)
   against ``private`` (the same plus the noise on the device, the dp_accounting
   epsilon of the ledger, the release file and its ledger entry in one
   transaction). The ratio private/plain is the price of privacy at Finalize.
   Each run is a fresh aggregation; warm-up (compilation) is excluded.
2. Epsilon of a ledger of R identical releases (Poisson q = 0.01, z = 1):
   clipd's ``engine._privacy.epsilon`` (identical events composed once with
   their count; its caches cleared before each run, so this is the cold cost)
   against composing the R events one by one into the same dp_accounting
   accountant (what a naive replay of a ledger does). Then what one more
   release costs once the event's RDP curve is known (a trainer's steps).
3. The noise of one release of P float32 parameters, in-process: ``default``
   (JAX's float32 normal added on the device, ``engine._privacy.add_gaussian_noise``)
   against ``secure`` (the sum on a grid plus OpenDP's discrete Gaussian,
   ``engine._secure_noise.release``, over every core in chunks). The ratio
   secure/default is the price of the secure sampler.

Run: ``python benchmarks/privacy.py`` (``--quick`` for a smoke run; ``--only noise
--release-sizes 1000000 100000000`` for the noise table alone at 10^6 and 10^8).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np


def finalize_latency(client, params: int, privacy, repeats: int) -> float:
    times = []
    rows = np.random.default_rng(0).standard_normal((8, params)).astype(np.float32)
    for _ in range(repeats + 1):
        agg = client.create_aggregation({"w": (params,)}, l2_norm_clip=1.0, privacy=privacy)
        client.submit(agg, {"w": rows})
        started = time.perf_counter()
        client.finalize(agg)
        times.append(time.perf_counter() - started)
        client.cancel(agg)
    return statistics.median(times[1:])  # the first one compiles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", choices=("finalize", "accounting", "noise"))
    parser.add_argument("--release-sizes", type=float, nargs="+", default=[1e6])
    parser.add_argument("--secure-repeats", type=int, default=1, help="the secure release at 10^8 takes minutes")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    if args.only in (None, "finalize"):
        finalize_table(args, repeats)
    if args.only in (None, "accounting"):
        accounting_table(args, repeats)
    if args.only in (None, "noise"):
        noise_table([1 << 14] if args.quick else [int(n) for n in args.release_sizes], repeats, args.secure_repeats)


def noise_table(sizes: list[int], repeats: int, secure_repeats: int) -> None:
    import os

    from clipd.engine import _privacy as dp
    from clipd.engine import _secure_noise as secure

    print()
    print(f"noise of one release, {os.cpu_count()} CPUs; medians of {repeats} (default) and {secure_repeats} (secure)")
    print(f"{'params':>12} | {'default ms':>10} | {'secure ms':>11} | {'secure/default':>14} | secure us/param")
    ratios = []
    for params in sizes:
        total = np.random.default_rng(0).standard_normal(params).astype(np.float32)
        default = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            dp.add_gaussian_noise([total], 1.0, dp.fresh_key(), [np.float32])
            default.append(time.perf_counter() - started)
        step, widened, scale = secure.plan(1.0, 1, 1.0, params)
        on_grid = np.rint(total.astype(np.float64) / step) * step  # what the fixed-point accumulator hands over
        timed = []
        for _ in range(secure_repeats):
            started = time.perf_counter()
            out = secure.release([on_grid], step, scale)
            timed.append(time.perf_counter() - started)
            assert np.array_equal(out.values[0] / out.step, np.round(out.values[0] / out.step))
        a, b = statistics.median(default[1:]), statistics.median(timed)  # the first default run compiles
        ratios.append(b / a)
        print(f"{params:>12,} | {a * 1e3:>10.3f} | {b * 1e3:>11.3f} | {b / a:>14.1f} | {b / params * 1e6:.2f}")
    print(f"noise: secure_over_default={ratios[-1]:.1f}")


def finalize_table(args, repeats: int) -> None:
    from clipd.client import Client, Privacy
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    sizes = [1 << 14] if args.quick else [1 << 14, 1 << 20, 1 << 23]
    with tempfile.TemporaryDirectory() as data_dir:
        server, port = create_server(Settings(host="127.0.0.1", grpc_port=0, admin_port=-1, data_dir=data_dir,
                                              max_message_bytes=64 << 20))
        try:
            with Client(f"127.0.0.1:{port}", max_message_bytes=64 << 20) as client:
                print(f"{'params':>10} | {'plain ms':>9} | {'private ms':>10} | {'private/plain':>13}")
                for params in sizes:
                    plain = finalize_latency(client, params, None, repeats)
                    private = finalize_latency(client, params, Privacy("bench", 1e-5, noise_multiplier=1.0,
                                                                        sampling="poisson", sampling_rate=0.01),
                                               repeats)
                    print(f"{params:>10,} | {plain * 1e3:>9.2f} | {private * 1e3:>10.2f} | {private / plain:>13.2f}")
        finally:
            server.stop(grace=1.0)


def accounting_table(args, repeats: int) -> None:
    from dp_accounting import dp_event as dpe
    from dp_accounting.rdp import rdp_privacy_accountant

    from clipd.engine import _privacy as dp

    event = dpe.PoissonSampledDpEvent(0.01, dpe.GaussianDpEvent(1.0))
    print()
    print(f"{'releases':>8} | {'clipd ms':>9} | {'one by one ms':>13} | {'one-by-one/clipd':>16}")
    for releases in ([5, 10] if args.quick else [10, 100, 1000]):  # quick (the smoke test): two short ledgers
        ours, naive = [], []
        for _ in range(repeats):
            dp._epsilon_of_counts.cache_clear()  # cold: nothing of this event computed before
            dp._rdp_curve.cache_clear()
            started = time.perf_counter()
            eps = dp.epsilon([event] * releases, 1e-5, "rdp", "add_remove_one")
            ours.append(time.perf_counter() - started)
            started = time.perf_counter()
            accountant = rdp_privacy_accountant.RdpAccountant()
            for _ in range(releases):
                accountant.compose(event)
            reference = accountant.get_epsilon(1e-5)
            naive.append(time.perf_counter() - started)
            assert abs(eps - reference) <= 1e-9 * reference, (eps, reference)
        a, b = statistics.median(ours), statistics.median(naive)
        print(f"{releases:>8} | {a * 1e3:>9.2f} | {b * 1e3:>13.2f} | {b / a:>16.2f}")
    warm, text = [], dp.event_to_json(event)  # a ledger holds its events as JSON
    for releases in range(1000, 1000 + repeats):  # each a ledger length not asked before; the event's curve known
        started = time.perf_counter()
        dp.epsilon_of_json([text] * releases, 1e-5, "rdp", "add_remove_one")
        warm.append(time.perf_counter() - started)
    print(f"a further release of a known event (what a trainer's step pays): {statistics.median(warm) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
