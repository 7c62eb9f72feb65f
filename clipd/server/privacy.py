"""Private releases: ledgers, their budgets, and the noised release at finalize.

The request path of a private aggregation:

1. ``CreateAggregation`` with a ``PrivacyPolicy``: :meth:`Ledgers.admit` opens
   (or finds) the ledger, computes its epsilon as if this release, and those
   of the ledger's other open aggregations, were made, and refuses
   (FAILED_PRECONDITION, with the numbers) past ``max_epsilon``; else the
   aggregation is stored and its release reserved. A debug aggregation writes
   a ``NonPrivateDpEvent`` to the ledger in the same commit.
2. Contributions are clipped and summed as usual; no raw statistic is shown.
3. ``Finalize``: the worker commits the raw totals (not yet FINALIZED), then
   :meth:`Ledgers.release` checks the budget again against the committed
   entries, draws the noise from a fresh key, updates the adaptive bound from
   the noised count, and commits the release, its ledger entry and the
   FINALIZED state in one transaction. A crash before that commit releases
   nothing (the drawn noise was never shown); a second Finalize returns the
   committed release.

Epsilon is always ``dp_accounting``'s, on the events as stored (JSON).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import threading
import time
import zlib
from collections.abc import Sequence

import jax
import numpy as np
from dp_accounting import dp_event as dpe

from clipd.engine import PartialState
from clipd.engine import _container as container
from clipd.engine import _privacy as dp
from clipd.engine import _secure_noise as secure
from clipd.server.aggregations import TAKES_BATCHES, Aggregation, State
from clipd.server.errors import FailedPrecondition
from clipd.server.stores.base import FAILED, LedgerConflict, LedgerEntry, LedgerRecord, Store

RELEASE_MAGIC = b"CLIPDRL2"  # a private release in clipd's container format (engine._container)
_LEGACY_RELEASE_MAGIC = b"CLIPDREL1\n"  # the format of releases stored before it (still read)
NON_PRIVATE = dp.event_to_json(dpe.NonPrivateDpEvent())  # a debug aggregation's entry: epsilon infinite


def ledger_config(policy: dp.PrivacyPolicy) -> dict:
    """What every aggregation of one ledger must agree on."""
    return {"accountant": policy.accountant.value, "neighbouring": policy.neighbouring.value,
            "delta": policy.delta, "max_epsilon": policy.max_epsilon}


def _same_config(stored: dict, wanted: dict) -> bool:
    return all(stored.get(k) == v for k, v in wanted.items())


@dataclasses.dataclass(frozen=True)
class Release:
    """A committed private release: the fields of the proto ``Release`` and the noised sums."""

    fields: dict
    sums: tuple[np.ndarray, ...]

    def to_bytes(self) -> bytes:
        """The release in clipd's container format: its fields in the header, its noised sums as arrays.

        >>> release = Release({"epsilon": 1.5}, (np.arange(3.0),))
        >>> again = Release.from_bytes(release.to_bytes())
        >>> again.fields, again.sums[0].tolist()
        ({'epsilon': 1.5}, [0.0, 1.0, 2.0])
        """
        return container.to_bytes(RELEASE_MAGIC, {"fields": self.fields},
                                  [(f"sums/{k}", np.asarray(s)) for k, s in enumerate(self.sums)])

    @classmethod
    def from_bytes(cls, blob: bytes) -> Release:
        """:meth:`to_bytes`'s blob (or one of the format before it); ``CorruptStateError`` if it is not intact."""
        if bytes(blob[:len(_LEGACY_RELEASE_MAGIC)]) == _LEGACY_RELEASE_MAGIC:
            return cls._from_legacy(blob)
        header, arrays = container.from_bytes(blob, RELEASE_MAGIC, "release")
        return cls(header["fields"], tuple(arrays[f"sums/{k}"] for k in range(len(arrays))))

    @classmethod
    def _from_legacy(cls, blob: bytes) -> Release:
        if zlib.crc32(blob[:-4]) != int.from_bytes(blob[-4:], "little"):
            raise container.CorruptStateError("release: checksum mismatch (truncated or corrupted)")
        at = len(_LEGACY_RELEASE_MAGIC)
        size = int.from_bytes(blob[at:at + 8], "little")
        header = json.loads(blob[at + 8:at + 8 + size])
        offset, sums = at + 8 + size, []
        for shape, dtype in header["arrays"]:
            dtype = np.dtype(dtype)
            n = math.prod(shape) * dtype.itemsize
            sums.append(np.frombuffer(blob, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape).copy())
            offset += n
        return cls(header["fields"], tuple(sums))


@dataclasses.dataclass
class _Reservation:
    aggregation: Aggregation  # its state says whether the reservation still counts
    event: str  # the DpEvent of its release, as JSON


class Ledgers:
    """The server's privacy ledgers: budget checks at creation and at release, and the releases."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._ledger_locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._reserved: dict[str, dict[str, _Reservation]] = collections.defaultdict(dict)
        self._events: dict[str, list[str]] = {}  # the committed events read so far, per ledger (see events)

    def _locked(self, ledger_id: str) -> threading.Lock:
        with self._lock:
            return self._ledger_locks[ledger_id]

    # Reading ---------------------------------------------------------------------------
    def events(self, ledger_id: str) -> list[str]:
        """The committed events of a ledger, as JSON: the ones read before and those committed since (by this
        process or another on a shared store): a trainer's ledger gains one per step, and is read at each
        creation and release. Call it under the ledger's lock (``_locked``): two callers at once could both
        append the entries after the same ``start``."""
        known = self._events.setdefault(ledger_id, [])
        known.extend(e.event for e in self.store.ledger_entries(ledger_id, start=len(known)))
        return list(known)

    def current_bound(self, policy: dp.PrivacyPolicy) -> float:
        """The adaptive bound of the ledger's next aggregation: the last release's next bound, or the initial one."""
        for entry in reversed(self.store.ledger_entries(policy.ledger_id)):
            if entry.next_bound is not None:
                return entry.next_bound
        assert policy.adaptive is not None  # called for adaptive clipping only
        return policy.adaptive.initial_bound

    def describe(self, ledger_id: str) -> dict | None:
        """A ledger as plain data (GetLedger, the admin API), or None if there is none."""
        record = next((r for r in self.store.ledgers() if r.ledger_id == ledger_id), None)
        if record is None:
            return None
        config = json.loads(record.config)
        entries = self.store.ledger_entries(ledger_id)
        eps = dp.epsilon_of_json([e.event for e in entries], config["delta"], config["accountant"],
                                 config["neighbouring"])
        bounds = [e.next_bound for e in entries if e.next_bound is not None]
        return {
            "ledger_id": ledger_id, **config, "epsilon": eps,
            "budget_left": config["max_epsilon"] - eps,
            "next_bound": bounds[-1] if bounds else 0.0,
            "debug_raw_statistics": any(e.event == NON_PRIVATE for e in entries),
            "entries": [dataclasses.asdict(e) for e in entries],
        }

    def ledger_ids(self) -> list[str]:
        return [r.ledger_id for r in self.store.ledgers()]

    # Creation --------------------------------------------------------------------------
    def admit(self, aggregation, policy: dp.PrivacyPolicy, plan: dp.ReleasePlan, create) -> float:
        """Checks the budget, then ``create(ledger_entry)`` stores the aggregation; returns the planned epsilon.

        ``FailedPrecondition`` if the ledger exists with another accountant,
        relation, delta or budget, or if this release (with the reserved ones)
        would pass ``max_epsilon``.
        """
        wanted = ledger_config(policy)
        with self._locked(policy.ledger_id):
            stored = self.store.ensure_ledger(LedgerRecord(policy.ledger_id, json.dumps(wanted), time.time()))
            if not _same_config(json.loads(stored.config), wanted):
                raise FailedPrecondition(f"ledger {policy.ledger_id!r} exists with {stored.config};"
                                         f" this aggregation asks {json.dumps(wanted)}")
            debug = [NON_PRIVATE] if policy.debug_raw_statistics else []
            reserved = [r.event for r in self._reserved[policy.ledger_id].values() if _counts(r.aggregation)]
            committed = self.events(policy.ledger_id)
            planned = _epsilon(policy, committed + reserved + debug + [plan.event_json])
            if planned > policy.max_epsilon:
                now = _epsilon(policy, committed)
                raise FailedPrecondition(
                    f"privacy budget of ledger {policy.ledger_id!r} exhausted: epsilon would reach {planned:.6g}"
                    f" (max_epsilon {policy.max_epsilon:g}, delta {policy.delta:g}); spent {now:.6g} in"
                    f" {len(committed)} entries, {len(reserved)} more releases reserved by open aggregations")
            entry = None
            if debug:
                entry = (policy.ledger_id, LedgerEntry(aggregation.id, NON_PRIVATE, time.time(),
                                                       _epsilon(policy, committed + debug)))
            create(entry)
            self._reserved[policy.ledger_id][aggregation.id] = _Reservation(aggregation, plan.event_json)
            return planned

    def reserve(self, aggregation, policy: dp.PrivacyPolicy, plan: dp.ReleasePlan) -> None:
        """Counts a recovered open aggregation's release against its ledger."""
        with self._locked(policy.ledger_id):
            self._reserved[policy.ledger_id][aggregation.id] = _Reservation(aggregation, plan.event_json)

    def forget(self, aggregation) -> None:
        if aggregation.privacy is None:
            return
        with self._locked(aggregation.privacy.ledger_id):
            self._reserved[aggregation.privacy.ledger_id].pop(aggregation.id, None)

    # Release ---------------------------------------------------------------------------
    def release(self, aggregation, totals: PartialState, sum_dtypes: Sequence[np.dtype]) -> Release:
        """Noises ``totals``, accounts the release and commits it with the FINALIZED state (see the module doc)."""
        policy: dp.PrivacyPolicy = aggregation.privacy
        plan: dp.ReleasePlan = aggregation.plan
        with self._locked(policy.ledger_id):
            committed = self.events(policy.ledger_id)
            after = _epsilon(policy, committed + [plan.event_json])
            if after > policy.max_epsilon:
                before = _epsilon(policy, committed)
                reason = (f"privacy budget of ledger {policy.ledger_id!r} exhausted: this release would take epsilon"
                          f" from {before:.6g} to {after:.6g}, past max_epsilon {policy.max_epsilon:g}")
                self.store.set_state(aggregation.id, FAILED, reason=reason, finished=time.time())  # never released
                self._reserved[policy.ledger_id].pop(aggregation.id, None)
                raise FailedPrecondition(reason)
            release = draw_release(aggregation, totals, sum_dtypes, after, _epsilon(policy, [plan.event_json]),
                                   len(committed) + 1)
            entry = LedgerEntry(aggregation.id, plan.event_json, time.time(), after,
                                release.fields["next_bound"] if policy.adaptive is not None else None)
            try:
                self.store.commit_release(aggregation.id, release.to_bytes(), policy.ledger_id, entry,
                                          len(committed), entry.time)
            except LedgerConflict as e:
                raise FailedPrecondition(f"{e}: another process released on it; finalize again") from e
            self._reserved[policy.ledger_id].pop(aggregation.id, None)
            return release


def _counts(aggregation: Aggregation) -> bool:
    """Whether an aggregation's reservation still counts: it may still be released."""
    return aggregation.state in (*TAKES_BATCHES, State.FINALIZING)


def _epsilon(policy: dp.PrivacyPolicy, events: list[str]) -> float:
    return dp.epsilon_of_json(events, policy.delta, policy.accountant, policy.neighbouring)


def draw_release(aggregation, totals: PartialState, sum_dtypes: Sequence[np.dtype], ledger_epsilon: float,
                 epsilon: float, releases: int) -> Release:
    """The noised sums, noised statistics and next bound of one release (fresh key each call)."""
    policy: dp.PrivacyPolicy = aggregation.privacy
    plan: dp.ReleasePlan = aggregation.plan
    key = dp.fresh_key(policy.seed)
    if policy.seed is not None:  # reproducible, yet no two releases of a ledger share noise
        key = jax.random.fold_in(key, releases)
    key_sum, key_count, key_stats = jax.random.split(key, 3)
    grid = {}
    if policy.noise is dp.Noise.SECURE:  # the totals were summed in fixed point on this grid
        on_grid = secure.release(totals.sums, plan.grid_step, plan.grid_scale)
        sums, grid = on_grid.values, {"grid_step": on_grid.step, "grid_noise_scale": on_grid.scale}
    else:
        sums = dp.add_gaussian_noise(totals.sums, plan.noise_stddev, key_sum, sum_dtypes)
    if policy.release_mean:
        sums = tuple((s / np.asarray(policy.public_denominator, s.dtype)).astype(s.dtype) for s in sums)
    bound = aggregation.policy.example_bound(aggregation.layers)
    examples = totals.examples
    fields = {
        "ledger_id": policy.ledger_id, "noise_multiplier": plan.noise_multiplier,
        "value_noise_multiplier": plan.value_noise_multiplier, "sensitivity": plan.sensitivity,
        "noise_stddev": plan.noise_stddev, "bound": bound, "next_bound": bound,
        "epsilon": epsilon, "ledger_epsilon": ledger_epsilon, "delta": policy.delta,
        "budget_left": policy.max_epsilon - ledger_epsilon, "dp_event_json": plan.event_json, **grid,
        "seeded": policy.seed is not None, "mean": policy.release_mean,
        "denominator": policy.public_denominator if policy.release_mean else 0.0,
        "ledger_releases": releases, "unclipped_fraction": 0.0,
        "debug_raw_statistics": policy.debug_raw_statistics,
        "statistics_noise_stddev": plan.metrics_noise_stddev,
        "example_norm_histogram": [], "layer_clipped": [], "examples": 0.0,
    }
    if policy.adaptive is not None:
        unclipped = examples - int(totals.clip_counts[0])
        centred = unclipped - examples / 2 + float(dp.gaussian_noise(1, plan.count_noise_stddev, key_count)[0])
        fraction = dp.unclipped_fraction(centred, policy.public_denominator)
        fields["unclipped_fraction"] = fraction
        fields["next_bound"] = dp.next_bound(bound, fraction, policy.adaptive)
    if policy.metrics_noise_multiplier > 0:
        raw = np.concatenate([totals.example_histogram, totals.clip_counts, [examples]]).astype(np.float64)
        noised = raw + dp.gaussian_noise(raw.size, plan.metrics_noise_stddev, key_stats)
        b, k = totals.example_histogram.size, totals.clip_counts.size
        fields["example_norm_histogram"] = noised[:b].tolist()
        fields["layer_clipped"] = noised[b:b + k].tolist()
        fields["examples"] = float(noised[-1])
    return Release(fields, sums)
