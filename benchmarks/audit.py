"""Canary audit benchmark: what an audit costs per release, and the lower bound it reaches against the claim.

Two tables, on the real server (in this process, durable SQLite store in a temp directory) through the Python
client, as a user's run does:

1. **Cost.** Finalize latency of a private release of P float32 parameters (one layer, 2 examples in it),
   ``plain private`` (Gaussian noise, no audit) against ``audited`` (the same ledger settings with
   ``Audit(canaries=N)``: the canaries added before the noise and taken out after it, their projections
   scored, the audit's state committed with the release). Medians of ``--repeats`` fresh aggregations, the
   first (compiling) one left out; the ratio audited/private is the audit's price. Beside it, the peak of the
   Python heap (numpy's arrays, traced by ``tracemalloc``) during one Finalize of each, and the size of the
   audit's state in the store.
2. **Power.** For each noise multiplier z, canaries N and releases R (no sampling; a model of 4N
   parameters; 4 examples per release): the claimed epsilon of the ledger after R releases, the audit's lower
   bound at 95% (the median over ``--seeds`` ledgers, each with its own noise and canaries), the most N
   canaries can show (the ceiling), and lower/claimed. Then the same with the noise broken on purpose in
   this process (a tenth of the claim's): the audit's bound against the same claim.

Run: ``python benchmarks/audit.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc
import uuid

import numpy as np


def _release(client, params: int, privacy, rows: np.ndarray) -> float:
    agg = client.create_aggregation({"w": (params,)}, l2_norm_clip=1.0, privacy=privacy)
    client.submit(agg, {"w": rows})
    started = time.perf_counter()
    client.finalize(agg)
    return time.perf_counter() - started


def cost_table(client, store, sizes: list[int], canaries: list[int], repeats: int) -> list[float]:
    from clipd.client import Audit, Privacy

    print(f"cost of one private release, {os.cpu_count()} CPUs; Finalize medians of {repeats}")
    print(f"{'params':>12} | {'canaries':>8} | {'private ms':>10} | {'audited ms':>10} | {'audited/private':>15} |"
          f" {'heap MB private':>15} | {'heap MB audited':>15} | audit state bytes")
    ratios = []
    for params in sizes:
        rows = np.random.default_rng(0).standard_normal((2, params)).astype(np.float32) * 0.01
        for n in canaries:
            timed: dict[str, list[float]] = {"private": [], "audited": []}
            heap = {}
            ledgers = {"private": f"plain-{uuid.uuid4().hex[:8]}", "audited": f"audited-{uuid.uuid4().hex[:8]}"}
            policies = {name: Privacy(ledger, 1e-5, noise_multiplier=1.0, audit=Audit(canaries=n) if name == "audited"
                                      else None) for name, ledger in ledgers.items()}
            for k in range(repeats + 1):
                for name in ("private", "audited") if k % 2 else ("audited", "private"):
                    timed[name].append(_release(client, params, policies[name], rows))
            for name in ("private", "audited"):
                tracemalloc.start()
                _release(client, params, policies[name], rows)
                heap[name] = tracemalloc.get_traced_memory()[1] / 1e6
                tracemalloc.stop()
            a, b = statistics.median(timed["private"][1:]), statistics.median(timed["audited"][1:])
            ratios.append(b / a)
            state = len(store.ledger_audit(ledgers["audited"]) or b"")
            print(f"{params:>12,} | {n:>8,} | {a * 1e3:>10.2f} | {b * 1e3:>10.2f} | {b / a:>15.3f} |"
                  f" {heap['private']:>15.1f} | {heap['audited']:>15.1f} | {state:,}")
    print(f"cost: audited_over_private={ratios[-1]:.3f}")
    return ratios


def power_table(client, zs: list[float], canaries: list[int], releases: list[int], seeds: int) -> None:
    from clipd.client import Audit, Privacy
    from clipd.engine import _privacy as dp

    print()
    print(f"power of an audit at 95% (delta 1e-5): medians over {seeds} ledgers; no sampling; 4N parameters")
    print(f"{'z':>5} | {'N':>6} | {'releases':>8} | {'claimed eps':>11} | {'lower bound':>11} | {'ceiling':>7} |"
          f" {'lower/claimed':>13} | {'noise /10: lower':>16} | refuted")
    real_noise = dp.add_gaussian_noise
    worst = 0.0
    for n in canaries:
        params = 4 * n
        for z in zs:
            for r in releases:
                found: dict[str, list[float]] = {"sound": [], "broken": []}
                claimed = ceiling = 0.0
                refuted = 0
                for seed in range(seeds):
                    for case in ("sound", "broken"):
                        if case == "broken":
                            dp.add_gaussian_noise = (lambda sums, stddev, key, dtypes, **more:  # type: ignore[assignment]
                                                     real_noise(sums, stddev / 10, key, dtypes, **more))
                        try:
                            ledger = f"power-{uuid.uuid4().hex[:8]}"
                            privacy = Privacy(ledger, 1e-5, noise_multiplier=z, seed=seed * 7919 + r,
                                              audit=Audit(canaries=n))
                            rng = np.random.default_rng(seed)
                            for _ in range(r):
                                rows = (rng.integers(-1, 2, size=(4, params)) / (8 * np.sqrt(params))).astype(
                                    np.float32)
                                _release(client, params, privacy, rows)
                            audit = client.close_audit(ledger).audit
                        finally:
                            dp.add_gaussian_noise = real_noise  # type: ignore[assignment]
                        found[case].append(audit.epsilon_lower)
                        claimed, ceiling = audit.epsilon_claimed, audit.epsilon_ceiling
                        refuted += case == "broken" and audit.refuted
                        if case == "sound":
                            worst = max(worst, audit.epsilon_lower / audit.epsilon_claimed)
                lower, broken = statistics.median(found["sound"]), statistics.median(found["broken"])
                print(f"{z:>5g} | {n:>6,} | {r:>8} | {claimed:>11.3f} | {lower:>11.3f} | {ceiling:>7.2f} |"
                      f" {lower / claimed:>13.3f} | {broken:>16.3f} | {refuted}/{seeds}")
    print(f"power: sound_max_lower_over_claimed={worst:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small size, few runs (a smoke run)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 22, 1 << 24])
    parser.add_argument("--only", choices=("cost", "power"))
    args = parser.parse_args()
    from clipd.client import Client
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    sizes = [1 << 14] if args.quick else args.sizes
    repeats = 2 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as data_dir:
        server, port = create_server(Settings(host="127.0.0.1", grpc_port=0, admin_port=-1, data_dir=data_dir,
                                              max_message_bytes=256 << 20, max_aggregations=10_000))
        try:
            with Client(f"127.0.0.1:{port}", max_message_bytes=256 << 20, timeout=600) as client:
                if args.only in (None, "cost"):
                    cost_table(client, server.store, sizes, [100] if args.quick else [1000, 10_000],
                               repeats)
                if args.only in (None, "power"):
                    power_table(client, [1.0] if args.quick else [0.5, 1.0, 2.0, 4.0],
                                [100] if args.quick else [100, 1000], [1] if args.quick else [1, 10],
                                1 if args.quick else args.seeds)
        finally:
            server.stop(grace=1.0)


if __name__ == "__main__":
    main()
