"""Canary audit benchmark: what an audit costs a round, what it can show, and what a stream's audit keeps.

Three tables, on the real server (in this process, durable SQLite store in a temp directory) through the Python
client, as a user's run does:

1. **Cost.** A private round of P float32 parameters (one layer): the aggregation created, ``--clients`` clients'
   updates submitted (``unit="client"``, one SubmitOne each), the release finalized; ``plain private`` (Gaussian
   noise, no audit) against ``audited`` (the same ledger settings with ``Audit(canaries=N)``: N canaries sent
   through the aggregation's unit, clip and step, their correct clips taken out after the noise, their
   projections scored, the audit's state committed with the release). Medians of ``--repeats`` rounds of each,
   alternated, after one of each that compiles; the ratio audited/private is the audit's price. Beside it, the
   peak of the Python heap (numpy's arrays, traced by ``tracemalloc``) during one round of each, and the size of
   the audit's state in the store.
2. **Power.** For each noise multiplier z, canaries N and releases R (no sampling; a model of 4N parameters;
   4 examples per release): the claimed epsilon of the ledger after R releases, the audit's lower bound at 95%
   (the median over ``--seeds`` ledgers, each with its own noise and canaries), the most N canaries can show
   (the ceiling), and, with the server broken on purpose in this process against the same claim, the bound
   reached when every contribution is bounded at 10 C (one line of ``multiplier``) and when the noise is a
   tenth of the claim's, with how many of the ledgers each refuted.
3. **A stream's audit state.** A correlated stream's audit keeps, per canary, the strategy's memory of its
   projections and signal and two running sums: its size after T releases of N canaries (the audit's own
   ``AuditState``, fed T releases of projections), against what keeping every release's projections took
   (8 bytes for each of the 2N canaries, a release), and the time a release adds to it.

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


def _round(client, params: int, privacy, updates: list[np.ndarray]) -> float:
    """One private round as a federated server runs it: create, each client's update, finalize; seconds."""
    started = time.perf_counter()
    agg = client.create_aggregation({"w": (params,)}, l2_norm_clip=1.0, privacy=privacy, unit="client")
    for k, update in enumerate(updates):
        client.submit(agg, {"w": update[None]}, client_id=f"c{k}")
    client.finalize(agg)
    took = time.perf_counter() - started
    client.cancel(agg)
    return took


def cost_table(client, store, sizes: list[int], canaries: list[int], repeats: int, clients: int) -> list[float]:
    from clipd.client import Audit, Privacy

    print(f"cost of one private round ({clients} clients' updates, unit client), {os.cpu_count()} CPUs;"
          f" medians of {repeats}")
    print(f"{'params':>12} | {'canaries':>8} | {'private ms':>10} | {'audited ms':>10} | {'audited/private':>15} |"
          f" {'heap MB private':>15} | {'heap MB audited':>15} | audit state bytes")
    ratios = []
    for params in sizes:
        rng = np.random.default_rng(0)
        updates = [(rng.standard_normal(params) * (2.0 / np.sqrt(params))).astype(np.float32) for _ in range(clients)]
        for n in canaries:
            timed: dict[str, list[float]] = {"private": [], "audited": []}
            heap = {}
            ledgers = {"private": f"plain-{uuid.uuid4().hex[:8]}", "audited": f"audited-{uuid.uuid4().hex[:8]}"}
            policies = {name: Privacy(ledger, 1e-5, noise_multiplier=1.0, audit=Audit(canaries=n) if name == "audited"
                                      else None) for name, ledger in ledgers.items()}
            for k in range(repeats + 1):
                for name in ("private", "audited") if k % 2 else ("audited", "private"):
                    timed[name].append(_round(client, params, policies[name], updates))
            for name in ("private", "audited"):
                tracemalloc.start()
                _round(client, params, policies[name], updates)
                heap[name] = tracemalloc.get_traced_memory()[1] / 1e6
                tracemalloc.stop()
            a, b = statistics.median(timed["private"][1:]), statistics.median(timed["audited"][1:])
            ratios.append(b / a)
            state = len(store.ledger_audit(ledgers["audited"]) or b"")
            print(f"{params:>12,} | {n:>8,} | {a * 1e3:>10.2f} | {b * 1e3:>10.2f} | {b / a:>15.3f} |"
                  f" {heap['private']:>15.1f} | {heap['audited']:>15.1f} | {state:,}")
    print(f"cost: audited_over_private={ratios[0]:.3f}")
    return ratios


def _release(client, params: int, privacy, rows: np.ndarray) -> None:
    agg = client.create_aggregation({"w": (params,)}, l2_norm_clip=1.0, privacy=privacy)
    client.submit(agg, {"w": rows})
    client.finalize(agg)


def _broken(case: str):
    """The server broken on purpose in this process (a context: restores it, and the compiled steps)."""
    import contextlib

    import jax

    from clipd.engine import _accumulator
    from clipd.engine import _privacy as dp

    @contextlib.contextmanager
    def patched():
        if case == "sound":
            yield
            return
        if case == "clip_10C":
            module, name = _accumulator, "multiplier"
            real = module.multiplier
            replacement = lambda norm, bound, rescale: real(norm, bound * 10, rescale)  # noqa: E731
        else:
            module, name = dp, "add_gaussian_noise"
            real = module.add_gaussian_noise
            replacement = lambda sums, stddev, key, dtypes, **more: real(sums, stddev / 10, key, dtypes, **more)  # noqa: E731
        setattr(module, name, replacement)
        jax.clear_caches()
        try:
            yield
        finally:
            setattr(module, name, real)
            jax.clear_caches()

    return patched()


def power_table(client, zs: list[float], canaries: list[int], releases: list[int], seeds: int) -> None:
    from clipd.client import Audit, Privacy

    print()
    print(f"power of an audit at 95% (delta 1e-5): medians over {seeds} ledgers; no sampling; 4N parameters")
    print(f"{'z':>5} | {'N':>6} | {'releases':>8} | {'claimed eps':>11} | {'lower bound':>11} | {'ceiling':>7} |"
          f" {'lower/claimed':>13} | {'clip 10C: lower':>15} | {'refuted':>7} | {'noise /10: lower':>16} | refuted")
    worst = 0.0
    for n in canaries:
        params = 4 * n
        for z in zs:
            for r in releases:
                found: dict[str, list[float]] = {"sound": [], "clip_10C": [], "noise_10": []}
                refuted = {"clip_10C": 0, "noise_10": 0}
                claimed = ceiling = 0.0
                for seed in range(seeds):
                    for case in found:
                        with _broken(case):
                            ledger = f"power-{uuid.uuid4().hex[:8]}"
                            privacy = Privacy(ledger, 1e-5, noise_multiplier=z, seed=seed * 7919 + r,
                                              audit=Audit(canaries=n))
                            rng = np.random.default_rng(seed)
                            for _ in range(r):
                                rows = (rng.integers(-1, 2, size=(4, params)) / (8 * np.sqrt(params))).astype(
                                    np.float32)
                                _release(client, params, privacy, rows)
                            audit = client.close_audit(ledger).audit
                        found[case].append(audit.epsilon_lower)
                        claimed, ceiling = audit.epsilon_claimed, audit.epsilon_ceiling
                        if case in refuted:
                            refuted[case] += audit.refuted
                        else:
                            worst = max(worst, audit.epsilon_lower / audit.epsilon_claimed)
                lower = statistics.median(found["sound"])
                clip, noise = statistics.median(found["clip_10C"]), statistics.median(found["noise_10"])
                print(f"{z:>5g} | {n:>6,} | {r:>8} | {claimed:>11.3f} | {lower:>11.3f} | {ceiling:>7.2f} |"
                      f" {lower / claimed:>13.3f} | {clip:>15.3f} | {refuted['clip_10C']:>5}/{seeds} |"
                      f" {noise:>16.3f} | {refuted['noise_10']}/{seeds}")
    print(f"power: sound_max_lower_over_claimed={worst:.3f}")


def stream_state_table(canaries: int, releases: int, mechanism: str) -> None:
    """A correlated stream's audit state, fed ``releases`` releases of ``canaries`` canaries' projections."""
    from clipd.engine import _audit as audit
    from clipd.engine._correlated import CorrelatedNoise
    from clipd.server.audit import AuditState, Canaries

    stream = CorrelatedNoise(mechanism, releases, min_separation=max(1, releases // 10), max_participations=10,
                             strategy=(0.9, 0.5, 0.2, 0.1) if mechanism == "blt" else (0.8, 0.4, 0.2))
    count = 2 * canaries
    state = AuditState(seed=1, canaries=canaries, confidence=0.95, scores=np.zeros(count))
    layout = audit.CanaryLayout(canaries, (), (), (), np.ones(count), np.ones(count, np.int64), np.ones(count),
                                audit.stream_starts(1, canaries, stream.min_separation))
    rng = np.random.default_rng(0)
    took = []
    for t in range(releases):
        canaries_t = Canaries(layout, audit.CanaryVectors((), ()), (), np.ones(count), np.zeros(count, bool))
        started = time.perf_counter()
        state.record(canaries_t, rng.standard_normal(count), 1.0, stream=stream, release=t)
        blob = state.to_bytes()
        took.append(time.perf_counter() - started)
    before = 8 * count * releases  # float64, held in and held out
    print()
    print(f"a stream's audit state ({mechanism}, {stream.state_rows} rows of memory), after {releases:,} releases")
    print(f"{'N':>7} | {'releases':>8} | {'state bytes':>12} | {'every projection kept':>21} | {'kept/state':>10} |"
          f" ms a release (record + encode)")
    print(f"{canaries:>7,} | {releases:>8,} | {len(blob):>12,} | {before:>21,} | {before / len(blob):>10.0f} |"
          f" {statistics.median(took) * 1e3:.2f}")
    print(f"stream: state_bytes={len(blob)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small size, few runs (a smoke run)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=10, help="clients' updates in a round of the cost table")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 22, 1 << 24])
    parser.add_argument("--canaries", type=int, nargs="+", default=[1000, 10_000])
    parser.add_argument("--only", choices=("cost", "power", "stream"))
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
                    cost_table(client, server.store, sizes, [100] if args.quick else args.canaries, repeats,
                               2 if args.quick else args.clients)
                if args.only in (None, "power"):
                    power_table(client, [1.0] if args.quick else [1.0, 2.0, 4.0, 8.0],
                                [100] if args.quick else [100, 1000], [1] if args.quick else [1, 10],
                                1 if args.quick else args.seeds)
        finally:
            server.stop(grace=1.0)
    if args.only in (None, "stream"):
        for mechanism in ("banded", "blt"):
            stream_state_table(100 if args.quick else 10_000, 20 if args.quick else 2000, mechanism)


if __name__ == "__main__":
    main()
