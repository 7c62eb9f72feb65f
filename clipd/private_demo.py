"""``clipd demo --noise-multiplier Z``: R private releases on one ledger, with Poisson sampling.

Each round samples the synthetic examples with rate Q (each joins with
probability Q, from the OS's randomness unless ``--seed-sampling`` makes it
reproducible from ``--seed``), streams them into an aggregation under a privacy policy on one
ledger, and finalizes it: the server adds the noise and accounts the release.
The last line is ``epsilon=<e> delta=<d> rounds=<r> noise_stddev=<s>``. ``--secure-noise``
draws a discrete Gaussian on an integer grid instead (accounted by zCDP, without
amplification by sampling: the sample is still drawn, its epsilon is not claimed). With
``--max-epsilon`` the ledger refuses the first round it can't afford: the demo
then says the budget is exhausted and exits non-zero. ``--mechanism blt`` (or ``banded``) noises the R
rounds with one correlated stream planned for R releases (DP-FTRL, one buffer or band; the demo's one client
takes part in every round: min separation 1, at most R participations; sampling is not claimed).
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

import numpy as np


def run(client, layers: dict, updates: dict[str, np.ndarray], args) -> int:
    from clipd.client import FailedPreconditionError, Privacy
    from clipd.client.dpsgd import poisson_sample

    ledger = f"demo-{uuid.uuid4().hex[:12]}"
    rate = args.sampling_rate
    correlated = args.mechanism != "independent"
    # The secure noise's accountant and a correlated stream's claim no amplification by sampling.
    claimed = rate < 1.0 and not args.secure_noise and not correlated
    stream: dict[str, Any] = dict(mechanism=args.mechanism, releases=args.rounds, min_separation=1,
                                  max_participations=args.rounds, buffers=1) if correlated else {}
    privacy = Privacy(
        ledger_id=ledger, delta=args.delta, noise_multiplier=args.noise_multiplier,
        sampling="poisson" if claimed else "none", sampling_rate=rate if claimed else 0.0,
        max_epsilon=args.max_epsilon or 0.0, public_denominator=rate * args.examples,
        noise="secure" if args.secure_noise else "gaussian", accountant="zcdp" if args.secure_noise else "rdp",
        **stream,
    )
    rng = np.random.default_rng(args.seed if args.seed_sampling else None)
    examples = len(next(iter(updates.values())))
    release = None
    print(f"{args.rounds} private rounds on ledger {ledger}: z = {args.noise_multiplier}, q = {rate},"
          f" C = {args.clip}, delta = {args.delta}" + (f", max epsilon {args.max_epsilon}" if args.max_epsilon else "")
          + (", secure noise (zCDP, sampling not claimed)" if args.secure_noise else "")
          + (f", one {args.mechanism} noise stream for the {args.rounds} rounds (sampling not claimed)"
             if correlated else ""))
    for round_ in range(1, args.rounds + 1):
        try:
            aggregation = client.create_aggregation(layers, policy=args.policy, l2_norm_clip=args.clip,
                                                    privacy=privacy)
        except FailedPreconditionError as e:
            print(f"privacy budget exhausted before round {round_}: {e.details}", file=sys.stderr)
            return 3
        chosen = poisson_sample(examples, rate, rng)
        if chosen.size:
            client.submit(aggregation, {name: u[chosen] for name, u in updates.items()})
        release = client.finalize(aggregation).release
        assert release is not None  # a private aggregation's result carries its release
        if not args.keep:
            client.cancel(aggregation)  # drops the kept result; the ledger keeps the release's event
        print(f"round {round_}: {chosen.size} examples sampled, noise stddev {release.noise_stddev:.4g},"
              f" epsilon so far {release.ledger_epsilon:.4f}")
    assert release is not None  # --rounds R: at least one round ran
    print(f"epsilon={release.ledger_epsilon:.6g} delta={args.delta:g} rounds={args.rounds}"
          f" noise_stddev={release.noise_stddev:.6g}")
    return 0
