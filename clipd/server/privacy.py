"""Private releases: ledgers, their budgets, and the noised release at finalize.

The request path of a private aggregation:

1. ``CreateAggregation`` with a ``PrivacyPolicy``: :meth:`Ledgers.admit` opens
   (or finds) the ledger, computes its epsilon as if this release, and those
   of the ledger's other open aggregations, were made, and refuses
   (FAILED_PRECONDITION, with the numbers) past ``max_epsilon``; else the
   aggregation is stored and its release reserved. A debug aggregation writes
   a ``NonPrivateDpEvent`` to the ledger in the same commit.
2. Contributions are clipped and summed as usual; no raw statistic is shown. A client the ledger's rules
   keep out of the release is refused before its bytes are read (:meth:`Ledgers.check_participation`): one
   the server did not draw, where the ledger's sampling is the server's (``server.sampling``), or one past a
   correlated stream's participation limits.
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
import functools
import json
import logging
import math
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from clipd.engine import PartialState, Unit
from clipd.engine import _buffered as buffered
from clipd.engine import _container as container
from clipd.engine import _privacy as dp
from clipd.engine import _secure_noise as secure
from clipd.engine._correlated import CorrelatedNoise, Mechanism
from clipd.server.aggregations import SELF_ASSERTED, TAKES_BATCHES, Aggregation, State
from clipd.server.audit import (
    AuditState,
    Canaries,
    by_layer,
    canaries_added,
    canaries_for,
    sampling_rate,
    take_canaries,
)
from clipd.server.audit import projections as canary_projections
from clipd.server.errors import FailedPrecondition, InvalidArgument, NotFound
from clipd.server.sampling import MAX_CANDIDATES, Draws
from clipd.server.sequences import client_of
from clipd.server.stores.base import FAILED, AuditRecord, LedgerConflict, LedgerEntry, LedgerRecord, NoiseStream, Store

log = logging.getLogger(__name__)

RELEASE_MAGIC = b"CLIPDRL2"  # a private release in clipd's container format (engine._container)
_LEGACY_RELEASE_MAGIC = b"CLIPDREL1\n"  # the format of releases stored before it (still read)
# A debug aggregation's entry (epsilon infinite): dp.event_to_json(dpe.NonPrivateDpEvent()), written out so that
# importing this module does not load dp_accounting (tests/test_privacy.py checks that the two agree).
NON_PRIVATE = '{"class_name": "NonPrivateDpEvent", "module_name": "dp_accounting.dp_event"}'


def ledger_config(policy: dp.PrivacyPolicy, plan: dp.ReleasePlan | None = None, parameters: int = 0,
                  unit: Unit = Unit.EXAMPLE, client_ids: str = "", stream_id: str = "") -> dict:
    """What every aggregation of one ledger must agree on: its accounting and its privacy ``unit`` (an epsilon
    is of one unit); where identities count, how they are established (``client_ids``); with correlated noise
    also the stream (mechanism, n, b, k, buffers, the optimized strategy, the model's ``parameters``: the size
    of each row of its state) and the noise stddev of every release."""
    config: dict[str, Any] = {"accountant": policy.accountant.value, "neighbouring": policy.neighbouring.value,
                              "delta": policy.delta, "max_epsilon": policy.max_epsilon,
                              "mechanism": Mechanism.INDEPENDENT.value, "unit": Unit(unit).value,
                              "client_ids": client_ids, "drawn_by": policy.sampling.drawn_by.value,
                              "audit": dataclasses.asdict(policy.audit) if policy.audit is not None else None,
                              "participation": (dataclasses.asdict(policy.participation)
                                                if policy.participation is not None else None),
                              "buffered_stream": stream_id}
    stream = policy.correlated
    if stream is not None:
        config["mechanism"] = stream.mechanism.value
        config["stream"] = {"releases": stream.releases, "min_separation": stream.min_separation,
                            "max_participations": stream.max_participations, "buffers": stream.buffers,
                            "declared": stream.declared, "strategy": list(stream.strategy), "parameters": parameters}
        if plan is not None:
            config["noise_stddev"] = plan.noise_stddev
    return config


# What a ledger stored before these fields existed had: independent noise, examples; its client ids, where they
# counted (a correlated stream's participation), were whatever a submitter named.
_CONFIG_DEFAULTS = {"mechanism": Mechanism.INDEPENDENT.value, "unit": Unit.EXAMPLE.value, "client_ids": "",
                    "audit": None, "drawn_by": dp.DrawnBy.CALLER.value, "participation": None, "buffered_stream": ""}


def _same_config(stored: dict, wanted: dict) -> bool:
    return all(stored.get(k, _CONFIG_DEFAULTS.get(k)) == v for k, v in wanted.items())


def _ids(client_ids: str | None) -> str:
    return repr(client_ids) if client_ids else "not counted"


def _config_difference(stored: dict, wanted: dict) -> str:
    """What a refused aggregation asks that its ledger has otherwise, in words."""
    differ = sorted((k for k in {*stored, *wanted}
                     if stored.get(k, _CONFIG_DEFAULTS.get(k)) != wanted.get(k, _CONFIG_DEFAULTS.get(k))),
                    key=lambda k: (k != "unit", k))  # the unit first: it decides the rest
    said = []
    for key in differ:
        has, asks = stored.get(key, _CONFIG_DEFAULTS.get(key)), wanted.get(key, _CONFIG_DEFAULTS.get(key))
        if key == "unit":
            said.append(f"its unit is {has!r} (its epsilon protects one {has}), this aggregation's {asks!r}: a"
                        " ledger accounts one unit; use another ledger")
        elif key == "audit":
            said.append(f"its audit is {json.dumps(has)}, this aggregation asks {json.dumps(asks)} (an audit is"
                        " the ledger's from its first aggregation on: start a new ledger to audit it)")
        elif key == "buffered_stream":
            has_words = f"buffered stream {has!r}'s ledger" if has else "the ledger of no stream"
            asks_words = f"stream {asks!r}'s buffer" if asks else "no stream's buffer"
            said.append(f"it is {has_words}, this aggregation is {asks_words} (a buffered stream's ledger is its"
                        " own: its releases are its versions)")
        elif key == "drawn_by":
            said.append(f"its releases' participants are drawn by the {has}, this aggregation's by the {asks} (who"
                        " draws is the ledger's from its first aggregation on: its amplification rests on it)")
        elif key == "client_ids":
            said.append(f"its client ids are {_ids(has)}, this aggregation's {_ids(asks)}"
                        + (" (a server without an admin token can only take self-asserted ids)"
                           if asks == SELF_ASSERTED else
                           " (create it with self_asserted_client_ids to go on with that ledger)"
                           if has == SELF_ASSERTED else ""))
        else:
            said.append(f"{key}: {json.dumps(has)}, this aggregation asks {json.dumps(asks)}")
    return "; ".join(said)


def ledger_epsilon(config: dict, events: Sequence[str]) -> float:
    """A ledger's epsilon: its entries' events composed; for a correlated stream, the last entry's alone (the
    first t releases are one Gaussian mechanism: ``CorrelatedNoise.prefix_noise_multiplier``), and so for a
    ledger with participation limits (each entry: a client's events over the releases made so far)."""
    if (config.get("mechanism", Mechanism.INDEPENDENT.value) != Mechanism.INDEPENDENT.value
            or config.get("participation")):
        events = [] if not events else (list(events) if NON_PRIVATE in events else list(events)[-1:])
    return dp.epsilon_of_json(list(events), config["delta"], config["accountant"], config["neighbouring"])


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
        self._events: dict[str, Tally] = {}  # the committed events read so far, per ledger (see events)
        self._configured: set[tuple[str, str]] = set()  # (ledger, config) the store has (a ledger's is fixed)
        self.participation_refusals: collections.Counter[str] = collections.Counter()  # per ledger, this process
        self.draws = Draws(store.submit_token_key)  # a server-drawn ledger's participants (server.sampling)

    def _locked(self, ledger_id: str) -> threading.Lock:
        with self._lock:
            return self._ledger_locks[ledger_id]

    # Reading ---------------------------------------------------------------------------
    def events(self, ledger_id: str) -> Tally:
        """The committed events of a ledger, as JSON counts: the ones read before and those committed since (by this
        process or another on a shared store): a trainer's ledger gains one per step, and is read at each
        creation and release. Call it under the ledger's lock (``_locked``): two callers at once could both
        append the entries after the same ``start``."""
        known = self._events.setdefault(ledger_id, Tally())
        known.extend(e.event for e in self.store.ledger_entries(ledger_id, start=len(known)))
        return known.copy()

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
        config = {**_CONFIG_DEFAULTS, **json.loads(record.config)}
        entries = self.store.ledger_entries(ledger_id)
        eps = ledger_epsilon(config, [e.event for e in entries])
        bounds = [e.next_bound for e in entries if e.next_bound is not None]
        stream = config.pop("stream", None)
        if stream is not None:  # the stream's plan and where it stands
            rows = _stream_of(config, stream).state_rows
            stream = {**stream, "made": len(entries), "left": stream["releases"] - len(entries), "state_rows": rows,
                      "state_bytes": rows * stream["parameters"] * 8}
        blob = self.store.ledger_audit(ledger_id)
        described = AuditState.from_bytes(blob).describe(eps, config["delta"]) if blob is not None else None
        return {
            "ledger_id": ledger_id, **config, "stream": stream, "epsilon": eps, "audit": described,
            "participation_refusals": self.participation_refusals[ledger_id],
            "budget_left": config["max_epsilon"] - eps,
            "next_bound": bounds[-1] if bounds else 0.0,
            "debug_raw_statistics": any(e.event == NON_PRIVATE for e in entries),
            "entries": [dataclasses.asdict(e) for e in entries],
        }

    def ledger_ids(self) -> list[str]:
        return [r.ledger_id for r in self.store.ledgers()]

    # Correlated noise ------------------------------------------------------------------
    def with_strategy(self, policy: dp.PrivacyPolicy) -> dp.PrivacyPolicy:
        """``policy`` with its correlated stream's strategy: the ledger's (stored with its first aggregation),
        or, for a new ledger, jax_privacy's optimum for (n, b, k) (slow: 10 to 60 s, once per ledger)."""
        stream = policy.correlated
        if stream is None or stream.strategy:
            return policy
        record = next((r for r in self.store.ledgers() if r.ledger_id == policy.ledger_id), None)
        stored = json.loads(record.config).get("stream") if record is not None else None
        if stored is not None and stored.get("strategy"):
            stream = dataclasses.replace(stream, strategy=tuple(stored["strategy"]))
        else:
            stream = stream.optimized()
        return dataclasses.replace(policy, correlated=stream)

    def check_participation(self, policy: dp.PrivacyPolicy, client_id: str) -> None:
        """Refuses (FAILED_PRECONDITION) a client the ledger's rules keep out of its next release: one the
        server did not draw (its sampling drawn by the server), or, on a correlated ledger whose participation
        the server enforces, or on a ledger with participation limits, one that took part in one of the last b - 1
        releases or in k already. The release is the ledger's next (one aggregation at a time is open on such a
        ledger; a buffered stream, whose buffers are open together, decides with :meth:`check_taken`)."""
        if policy.sampling.drawn_by is dp.DrawnBy.SERVER:
            client = client_of(client_id)
            release = self.next_release(policy.ledger_id)
            if not self.draws.drawn(policy.ledger_id, release, [client], policy.sampling.rate)[0]:
                self.participation_refusals[policy.ledger_id] += 1
                raise FailedPrecondition(f"client {client!r} was not drawn for this release (release {release} of"
                                         f" ledger {policy.ledger_id!r}): the server draws each release's clients"
                                         f" (Poisson, rate {policy.sampling.rate:g}); DrawClients says which are")
            return
        if participation_limits(policy) is None:
            return
        client = client_of(client_id)
        taken = sorted(self.store.participations(policy.ledger_id, client))
        release = 0
        if taken:
            with self._locked(policy.ledger_id):
                release = len(self.events(policy.ledger_id))
        self.check_taken(policy, client, taken, release)

    def check_taken(self, policy: dp.PrivacyPolicy, client: str, taken: Sequence[int], release: int) -> None:
        """Refuses (FAILED_PRECONDITION) ``client``, whose releases so far are ``taken`` (0-based, ascending), in
        release ``release`` of a ledger with participation limits (its own or its correlated stream's): past its
        k, or within b of its last. What :meth:`check_participation` decides once it knows them (a buffered
        stream, whose ledger is its own, knows them without asking the store)."""
        limits = participation_limits(policy)
        if limits is None or not taken:
            return
        whose = "its stream" if policy.correlated is not None else "it"
        if len(taken) >= limits.max_participations:
            reason = (f"client {client!r} took part in {len(taken)} releases of ledger {policy.ledger_id!r} (releases"
                      f" {list(taken)}); {whose} allows at most {limits.max_participations} (max_participations)")
        elif release - taken[-1] < limits.min_separation:
            reason = (f"client {client!r} took part in release {taken[-1]} of ledger {policy.ledger_id!r}; this is"
                      f" release {release} and {whose} needs {limits.min_separation} between two"
                      f" (min_separation): it may take part again from release {taken[-1] + limits.min_separation}")
        else:
            return
        self.participation_refusals[policy.ledger_id] += 1
        raise FailedPrecondition(reason)

    def next_release(self, ledger_id: str) -> int:
        """The ledger's next release (1-based): its committed entries plus one."""
        with self._locked(ledger_id):
            return len(self.events(ledger_id)) + 1

    def draw_clients(self, aggregation, candidates: Sequence[str]) -> tuple[int, float, list[str]]:
        """The candidates the server draws for the release of ``aggregation`` (its ledger's next): ``(release,
        rate, drawn ones in the order given)``. ``FailedPrecondition`` unless its sampling is the server's."""
        policy: dp.PrivacyPolicy | None = aggregation.privacy
        if policy is None or policy.sampling.drawn_by is not dp.DrawnBy.SERVER:
            raise FailedPrecondition(f"aggregation {aggregation.id}: its participants are not drawn by the server"
                                     " (Privacy(..., sampling='poisson', sampling_rate=q, drawn_by='server') asks it"
                                     " to draw them)")
        if len(candidates) > MAX_CANDIDATES:
            raise InvalidArgument(f"client_ids: at most {MAX_CANDIDATES} candidates a call, got {len(candidates)}")
        release = self.next_release(policy.ledger_id)
        drawn = self.draws.drawn(policy.ledger_id, release, [client_of(c) for c in candidates], policy.sampling.rate)
        return release, policy.sampling.rate, [c for c, d in zip(candidates, drawn) if d]

    # Creation --------------------------------------------------------------------------
    def admit(self, aggregation, policy: dp.PrivacyPolicy, plan: dp.ReleasePlan, create) -> float:
        """Checks the budget, then ``create(ledger_entry)`` stores the aggregation; returns the planned epsilon.

        ``FailedPrecondition`` if the ledger exists with another accountant,
        relation, delta or budget, or if this release (with the reserved ones)
        would pass ``max_epsilon``.
        """
        wanted = ledger_config(policy, plan, aggregation.parameters, aggregation.unit, aggregation.client_ids,
                               aggregation.spec.stream)
        with self._locked(policy.ledger_id):
            configured = (policy.ledger_id, json.dumps(wanted, sort_keys=True))
            if configured not in self._configured:  # (a stream's buffers, a job's rounds: asked once)
                stored = self.store.ensure_ledger(LedgerRecord(policy.ledger_id, json.dumps(wanted), time.time()))
                if not _same_config(json.loads(stored.config), wanted):
                    raise FailedPrecondition(f"ledger {policy.ledger_id!r} exists with another configuration:"
                                             f" {_config_difference(json.loads(stored.config), wanted)}")
                self._configured.add(configured)
            debug = [NON_PRIVATE] if policy.debug_raw_statistics else []
            reserved = [r.event for r in self._reserved[policy.ledger_id].values() if _counts(r.aggregation)]
            committed = self.events(policy.ledger_id)
            if policy.audit is not None:
                self._open_audit(policy, committed)
            one_at_a_time = policy.sampling.drawn_by is dp.DrawnBy.SERVER or (
                policy.participation is not None and not aggregation.spec.stream)
            if one_at_a_time and reserved:
                open_ids = [i for i, r in self._reserved[policy.ledger_id].items() if _counts(r.aggregation)]
                why = ("draws each release's clients itself" if policy.sampling.drawn_by is dp.DrawnBy.SERVER
                       else "limits each client's participation")
                raise FailedPrecondition(
                    f"ledger {policy.ledger_id!r} {why}, release by release: one aggregation at a time; finalize or"
                    f" cancel {', '.join(open_ids)} first")
            if policy.correlated is not None:
                planned = self._admit_to_stream(policy, plan, committed, reserved, bool(aggregation.spec.stream))
                create(None)
                self._reserved[policy.ledger_id][aggregation.id] = _Reservation(aggregation, plan.event_json)
                return planned
            if policy.participation is not None:  # a client's events over the releases made by then
                planned = _epsilon(policy, [dp.participation_event(plan.event_json, len(committed) + len(reserved) + 1,
                                                                   policy.participation)])
            else:
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

    def _open_audit(self, policy: dp.PrivacyPolicy, committed: Tally) -> None:
        """The ledger's audit, made with its first aggregation; FAILED_PRECONDITION on a ledger with releases
        made without one (an audit covers a ledger from its first release)."""
        if self.store.ledger_audit(policy.ledger_id) is not None:
            return
        if committed:
            raise FailedPrecondition(f"ledger {policy.ledger_id!r} has {len(committed)} entries made without an"
                                     " audit: an audit covers a ledger from its first release; start a new ledger")
        self.store.save_ledger_audit(policy.ledger_id, AuditRecord(AuditState.new(policy).to_bytes()), create=True)

    def _audit_of(self, policy: dp.PrivacyPolicy) -> AuditState | None:
        """The ledger's audit while it takes releases (None: no audit, closed, or one of the format before,
        which covers the releases it has and is closed as it is)."""
        if policy.audit is None:
            return None
        blob = self.store.ledger_audit(policy.ledger_id)
        state = AuditState.from_bytes(blob) if blob is not None else None
        return state if state is not None and state.takes_releases else None

    def close_audit(self, ledger_id: str) -> dict:
        """Closes the ledger's audit (CloseAudit): its bound against the ledger's epsilon now; the ledger
        described. ``NotFound`` without a ledger, ``FailedPrecondition`` without an audit."""
        with self._locked(ledger_id):
            record = next((r for r in self.store.ledgers() if r.ledger_id == ledger_id), None)
            if record is None:
                raise NotFound(f"no ledger {ledger_id!r}")
            blob = self.store.ledger_audit(ledger_id)
            if blob is None:
                raise FailedPrecondition(f"ledger {ledger_id!r} has no audit (Privacy(..., audit=Audit(...)) on"
                                         " its first aggregation makes one)")
            state = AuditState.from_bytes(blob)
            if not state.closed:
                config = {**_CONFIG_DEFAULTS, **json.loads(record.config)}
                events = [e.event for e in self.store.ledger_entries(ledger_id)]  # (in order: a prefix is read)
                stream = _stream_of(config, config["stream"]) if config.get("stream") else None
                state.close(config["delta"], stream, config.get("noise_stddev", 0.0),
                            ledger_epsilon(config, events[:state.releases]))
                self.store.save_ledger_audit(ledger_id, AuditRecord(state.to_bytes(), closed=True))
        described = self.describe(ledger_id)
        assert described is not None
        return described

    def _admit_to_stream(self, policy: dp.PrivacyPolicy, plan: dp.ReleasePlan, committed: Tally,
                         reserved: list[str], buffered: bool = False) -> float:
        """A correlated ledger's next aggregation: one open at a time (a buffered stream's buffers, released in
        version order, may be open together), the stream not spent by the releases made and reserved, its whole
        plan within the budget; the ledger's epsilon once this release is made."""
        stream = policy.correlated
        assert stream is not None
        if reserved and not buffered:
            open_ids = [i for i, r in self._reserved[policy.ledger_id].items() if _counts(r.aggregation)]
            raise FailedPrecondition(
                f"ledger {policy.ledger_id!r} releases one correlated noise stream in order: one aggregation at a"
                f" time; finalize or cancel {', '.join(open_ids)} first")
        made = len(committed) + len(reserved)
        if made >= stream.releases:
            raise FailedPrecondition(
                f"the noise stream of ledger {policy.ledger_id!r} is spent: {made} of its {stream.releases} planned"
                f" releases are made{' or open' if reserved else ''} (a stream is accounted for its planned releases"
                " only; start a new ledger)")
        whole = _epsilon(policy, [plan.event_json])
        if whole > policy.max_epsilon:
            raise FailedPrecondition(
                f"privacy budget of ledger {policy.ledger_id!r}: its stream of {stream.releases} releases (noise"
                f" multiplier {plan.noise_multiplier:.6g}) spends epsilon {whole:.6g}, past max_epsilon"
                f" {policy.max_epsilon:g} (delta {policy.delta:g}); raise the noise or the budget")
        return _epsilon(policy, [stream_event_json(policy, plan, made + 1)])

    def _release_from_stream(self, aggregation, totals: PartialState, sum_dtypes: Sequence[np.dtype],
                             committed: Tally, drop=None) -> Release:
        """A correlated ledger's release (under its lock): the stream's next noise row added to the sums, its
        state, the ledger entry, the participants and the release committed together."""
        policy: dp.PrivacyPolicy = aggregation.privacy
        plan: dp.ReleasePlan = aggregation.plan
        stream = policy.correlated
        assert stream is not None
        made = len(committed)
        if made >= stream.releases:
            self._refuse_release(aggregation, policy, f"the noise stream of ledger {policy.ledger_id!r} is spent:"
                                                      f" {made} of its {stream.releases} releases are made")
        event_json = stream_event_json(policy, plan, made + 1)
        after = _epsilon(policy, [event_json])
        parameters = sum(int(np.prod(s.shape)) for s in totals.sums)
        stored = self.store.noise_stream(policy.ledger_id)
        if stored is None:
            state, position = np.zeros((stream.state_rows, parameters)), 0
        else:
            state, position = stream_state_from_bytes(stored.state)
        if position != made or state.shape != (stream.state_rows, parameters):
            raise FailedPrecondition(f"the noise stream of ledger {policy.ledger_id!r} stands at release {position}"
                                     f" ({state.shape}), its ledger at {made} ({(stream.state_rows, parameters)})")
        key = dp.fresh_key(policy.seed)
        if policy.seed is not None:  # reproducible (a restart continues the same stream), no release alike
            key = jax.random.fold_in(key, made + 1)
        noise = stream.step(dp.gaussian_noise(parameters, 1.0, key), state) * plan.noise_stddev
        audit_state = self._audit_of(policy)
        canaries = canaries_for(audit_state, aggregation, made + 1) if audit_state is not None else None
        sums = list(totals.sums)
        noised, at = [], 0
        with canaries_added(sums, canaries, aggregation) as raw:
            for total, dtype in zip(sums, sum_dtypes):
                size = int(np.prod(total.shape))
                value = np.asarray(total, np.float64) + noise[at:at + size].reshape(total.shape)
                noised.append(value.astype(np.promote_types(dtype, np.float32)))
                at += size
        if raw is not None:
            assert audit_state is not None and canaries is not None  # (raw values: an audit's canaries were in)
            noised_sums, projections = take_canaries(noised, canaries, raw)
            noised = list(noised_sums)
            audit_state.record(canaries, projections, plan.noise_stddev, stream=stream, release=made)
            if made + 1 == stream.releases:  # the stream's last release closes its audit
                try:
                    audit_state.close(policy.delta, stream, plan.noise_stddev, after)
                except Exception:  # the release stands; the audit stays open (CloseAudit computes it again)
                    log.exception("ledger %s: closing its audit with its stream's last release failed",
                                  policy.ledger_id)
                    audit_state.result = None
        release, _ = draw_release(aggregation, totals, sum_dtypes, after, 0.0, made + 1, tuple(noised))
        release.fields.update(stream_release_fields(policy, plan, made))
        release.fields["dp_event_json"] = event_json
        participants = [] if stream.declared else sorted({client_of(c) for c in totals.clients})
        entry = LedgerEntry(aggregation.id, event_json, time.time(), after, None)
        try:
            self.store.commit_release(aggregation.id, release.to_bytes(), policy.ledger_id, entry, made, entry.time,
                                      stream=NoiseStream(made + 1, stream_state_to_bytes(state, made + 1)),
                                      participants=participants,
                                      audit=audit_state.record_of() if audit_state is not None else None,
                                      **_made_and_dropped(aggregation, drop))
        except LedgerConflict as e:
            raise FailedPrecondition(f"{e}: another process released on it; finalize again") from e
        aggregation.unrecorded = None
        self._reserved[policy.ledger_id].pop(aggregation.id, None)
        return release

    def _refuse_release(self, aggregation, policy: dp.PrivacyPolicy, reason: str) -> None:
        """The aggregation is never released: FAILED with ``reason`` (raised)."""
        _record_failure(self.store, aggregation, reason)
        self._reserved[policy.ledger_id].pop(aggregation.id, None)
        raise FailedPrecondition(reason)

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
    def release(self, aggregation, totals: PartialState, sum_dtypes: Sequence[np.dtype], drop=None) -> Release:
        """Noises ``totals``, accounts the release and commits it with the FINALIZED state (see the module doc).

        The same commit writes the aggregation's record if it waited for its release (``unrecorded``: a DP-SGD
        step's) and deletes ``drop``'s rows (a finalized aggregation: the trainer's step before)."""
        policy: dp.PrivacyPolicy = aggregation.privacy
        plan: dp.ReleasePlan = aggregation.plan
        with self._locked(policy.ledger_id):
            committed = self.events(policy.ledger_id)
            if policy.correlated is not None:
                return self._release_from_stream(aggregation, totals, sum_dtypes, committed, drop)
            event_json = plan.event_json
            if policy.participation is not None:  # the entry: a client's events over the releases made
                event_json = dp.participation_event(plan.event_json, len(committed) + 1, policy.participation)
                after = _epsilon(policy, [event_json])
            else:
                after = _epsilon(policy, committed + [event_json])
            if after > policy.max_epsilon:
                before = _epsilon(policy, committed)
                reason = (f"privacy budget of ledger {policy.ledger_id!r} exhausted: this release would take epsilon"
                          f" from {before:.6g} to {after:.6g}, past max_epsilon {policy.max_epsilon:g}")
                _record_failure(self.store, aggregation, reason)  # never released
                self._reserved[policy.ledger_id].pop(aggregation.id, None)
                raise FailedPrecondition(reason)
            state = self._audit_of(policy)
            canaries = canaries_for(state, aggregation, len(committed) + 1) if state is not None else None
            release, projections = draw_release(aggregation, totals, sum_dtypes, after,
                                                _epsilon(policy, [plan.event_json]), len(committed) + 1,
                                                canaries=canaries)
            if state is not None and canaries is not None:
                state.record(canaries, projections, plan.noise_stddev)
            entry = LedgerEntry(aggregation.id, event_json, time.time(), after,
                                release.fields["next_bound"] if policy.adaptive is not None else None)
            participants = (sorted({client_of(c) for c in totals.clients}) if policy.participation is not None
                            else [])
            try:
                self.store.commit_release(aggregation.id, release.to_bytes(), policy.ledger_id, entry,
                                          len(committed), entry.time, participants=participants,
                                          audit=state.record_of() if state is not None else None,
                                          **_made_and_dropped(aggregation, drop))
            except LedgerConflict as e:
                raise FailedPrecondition(f"{e}: another process released on it; finalize again") from e
            aggregation.unrecorded = None
            self._reserved[policy.ledger_id].pop(aggregation.id, None)
            return release


def _made_and_dropped(aggregation, drop) -> dict:
    """What a release's commit also does: write the aggregation's record (a DP-SGD step's, which waited for its
    release), delete ``drop``'s rows (the trainer's step before)."""
    return {"record": aggregation.unrecorded, "drop": drop.id if drop is not None else ""}


def _record_failure(store: Store, aggregation, reason: str) -> None:
    """FAILED in the store, with ``reason`` (an aggregation with no record yet, a step's, has nothing to mark)."""
    if aggregation.unrecorded is None:
        store.set_state(aggregation.id, FAILED, reason=reason, finished=time.time())


STREAM_MAGIC = b"CLIPDNS1"  # a ledger's noise stream state in clipd's container format (engine._container)


def stream_state_to_bytes(state: np.ndarray, releases: int) -> bytes:
    """A noise stream's state (its rows of the model's size, float64) after ``releases`` releases."""
    return container.to_bytes(STREAM_MAGIC, {"releases": releases}, [("state", state)])


def stream_state_from_bytes(blob: bytes) -> tuple[np.ndarray, int]:
    header, arrays = container.from_bytes(blob, STREAM_MAGIC, "noise stream")
    return arrays["state"], int(header["releases"])


def stream_event_json(policy: dp.PrivacyPolicy, plan: dp.ReleasePlan, made: int) -> str:
    """The ledger entry of a correlated stream's ``made``-th release: the Gaussian event of its first ``made``
    releases together (the ledger's epsilon is that entry's alone, :func:`ledger_epsilon`)."""
    assert policy.correlated is not None
    if plan.noise_multiplier == 0:
        return NON_PRIVATE
    from dp_accounting import dp_event as dpe

    return dp.event_to_json(dpe.GaussianDpEvent(policy.correlated.prefix_noise_multiplier(plan.noise_multiplier,
                                                                                           made)))


def stream_release_fields(policy: dp.PrivacyPolicy, plan: dp.ReleasePlan, release: int) -> dict:
    """What a correlated stream's release ``release`` (0-based) says of its noise: the whole stream's
    sensitivity ``bound * sens(C)`` (the noise's calibration), this release's stddev per coordinate
    ``sigma * ||row release of C^-1||`` beside the stream's ``sigma``, this release's epsilon alone (a
    Gaussian of that stddev over the bound's sensitivity) and the stream with its strategy."""
    from dp_accounting import dp_event as dpe

    stream = policy.correlated
    assert stream is not None
    stddev = plan.noise_stddev * stream.release_noise_scale(release)
    alone = (dpe.GaussianDpEvent(stddev / plan.sensitivity) if stddev > 0 and plan.sensitivity > 0
             else dpe.NonPrivateDpEvent())
    return {"mechanism": stream.mechanism.value, "stream_release": release, "stream_releases": stream.releases,
            "sensitivity": plan.sensitivity * stream.sensitivity(), "noise_stddev": stddev,
            "stream_noise_stddev": plan.noise_stddev, "epsilon": _epsilon(policy, [dp.event_to_json(alone)]),
            "stream": {"mechanism": stream.mechanism.value, "releases": stream.releases,
                       "min_separation": stream.min_separation, "max_participations": stream.max_participations,
                       "buffers": stream.buffers, "declared": stream.declared, "strategy": list(stream.strategy)}}


def _stream_of(config: dict, stream: dict) -> CorrelatedNoise:
    """A stored correlated ledger's stream."""
    return CorrelatedNoise(config["mechanism"], stream["releases"], stream["min_separation"],
                           stream["max_participations"], stream["buffers"], stream["declared"],
                           tuple(stream["strategy"]))


def participation_limits(policy: dp.PrivacyPolicy) -> dp.Participation | None:
    """The participation limits the server enforces per client on a ledger: a correlated stream's (unless its
    participation is declared), or an independent ledger's own; None: none."""
    stream = policy.correlated
    if stream is not None:
        return None if stream.declared else dp.Participation(stream.min_separation, stream.max_participations)
    return policy.participation


def _counts(aggregation: Aggregation) -> bool:
    """Whether an aggregation's reservation still counts: it may still be released."""
    return aggregation.state in (*TAKES_BATCHES, State.FINALIZING)


class Tally:
    """Events (JSON) by their counts: a ledger's committed events, kept as they come (a trainer's
    ledger gains one a step, and its epsilon is asked at each step of the counts, not of a list that grows).
    ``tally + [events]`` is a new tally (a copy of the counts: a ledger holds few distinct events).

    >>> t = Tally(["a", "b", "a"])
    >>> len(t + ["a"]), dict((t + ["a"]).counts), len(t)
    (4, {'a': 3, 'b': 1}, 3)
    """

    def __init__(self, events=()) -> None:
        self.counts: collections.Counter[str] = collections.Counter(events)

    def extend(self, events) -> None:
        self.counts.update(events)

    def copy(self) -> Tally:
        tally = Tally()
        tally.counts = collections.Counter(self.counts)
        return tally

    def __add__(self, events: list[str]) -> Tally:
        tally = self.copy()
        tally.extend(events)
        return tally

    def __len__(self) -> int:
        return self.counts.total()

    def elements(self) -> list[str]:
        return list(self.counts.elements())


def _epsilon(policy: dp.PrivacyPolicy, events: list[str] | Tally) -> float:
    if len(events) <= FEW_EVENTS:  # a participation-limited or correlated ledger's one entry: asked again and again
        few = events.elements() if isinstance(events, Tally) else events
        return _epsilon_of_few(tuple(sorted(few)), policy.delta, policy.accountant, policy.neighbouring)
    if isinstance(events, Tally):
        return dp.epsilon_of_counts(events.counts, policy.delta, policy.accountant, policy.neighbouring)
    return dp.epsilon_of_json(events, policy.delta, policy.accountant, policy.neighbouring)


FEW_EVENTS = 4  # ledgers of this many events at most have their epsilon remembered (_epsilon_of_few)


@functools.lru_cache(maxsize=512)
def _epsilon_of_few(events: tuple[str, ...], delta: float, accountant: dp.Accountant,
                    neighbouring: dp.Neighbouring) -> float:
    """The epsilon of a few events, remembered: a buffered stream's ledger is one event (its client's k
    releases, or its noise stream's prefix), computed at each buffer's admission and again at its release, and
    PLD takes half a second for it here."""
    return dp.epsilon_of_json(list(events), delta, accountant, neighbouring)


def prepare_release(aggregation) -> None:
    """Compiles, on a thread, the noise program that :func:`draw_release` will run for this private aggregation,
    where it is the plain Gaussian one (``dp.prepare_noise``): not for a correlated stream (its sums come noised),
    secure noise (drawn on the host) or an audited ledger (its canaries are taken out by another program)."""
    policy: dp.PrivacyPolicy = aggregation.privacy
    if (aggregation.plan.noise_stddev > 0 and policy.noise is dp.Noise.GAUSSIAN and policy.correlated is None
            and policy.audit is None):
        dp.prepare_noise([layer.shape for layer in aggregation.layers], aggregation.accumulator.sum_dtypes)


def draw_release(aggregation, totals: PartialState, sum_dtypes: Sequence[np.dtype], ledger_epsilon: float,
                 epsilon: float, releases: int, noised_sums: tuple[np.ndarray, ...] | None = None,
                 canaries: Canaries | None = None) -> tuple[Release, np.ndarray]:
    """The noised sums, noised statistics and next bound of one release (fresh key each call); ``noised_sums``:
    the sums already noised (a correlated stream's release). ``canaries``: an audit's, added to the sums before
    the noise and taken out of the release after it; returned with the release: their projections on it (empty
    without canaries)."""
    policy: dp.PrivacyPolicy = aggregation.privacy
    plan: dp.ReleasePlan = aggregation.plan
    key_sum, key_count, key_stats = dp.release_keys(policy.seed, releases)
    grid: dict = {}
    seen = np.zeros(0)
    if noised_sums is not None:
        sums = noised_sums
    else:
        raw_sums = list(totals.sums)
        with canaries_added(raw_sums, canaries, aggregation) as raw:
            if policy.noise is dp.Noise.SECURE:  # the totals were summed in fixed point on this grid
                on_grid = secure.release(raw_sums, plan.grid_step, plan.grid_scale)
                sums, grid = on_grid.values, {"grid_step": on_grid.step, "grid_noise_scale": on_grid.scale}
            elif canaries is None or max(np.size(s) for s in raw_sums) >= 2 ** 31:  # (the device indexes in int32)
                sums = dp.add_gaussian_noise(raw_sums, plan.noise_stddev, key_sum, sum_dtypes)
            else:  # the canaries taken out on the device: no copy of the release
                assert raw is not None
                sums = dp.add_gaussian_noise(raw_sums, plan.noise_stddev, key_sum, sum_dtypes,
                                             minus=by_layer(canaries))
                seen = canary_projections(sums, canaries, raw, taken_out=True)
        if raw is not None and not seen.size:  # the canaries still in the release: taken out on the host
            assert canaries is not None
            sums, seen = take_canaries(sums, canaries, raw)
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
        "unit": aggregation.unit.value, "client_ids": aggregation.client_ids,
        "sampling": policy.sampling.kind.value, "sampling_rate": sampling_rate(policy.sampling),
        "sampling_drawn_by": policy.sampling.drawn_by.value,
    }
    if aggregation.spec.stream:  # a buffered stream's buffer: the version it is, its contributions, their staleness
        version = aggregation.spec.version
        fields.update(stream_id=aggregation.spec.stream, stream_version=version, contributions=len(totals.clients),
                      staleness=sorted(buffered.staleness(version, buffered.trained_from(writer))
                                       for _, writer in totals.clients.values()))
    if policy.adaptive is not None:
        unclipped = examples - int(totals.clip_counts[0])
        centred = unclipped - examples / 2 + float(dp.gaussian_noise(1, plan.count_noise_stddev, key_count)[0])
        fraction = dp.unclipped_fraction(centred, policy.public_denominator)
        fields["unclipped_fraction"] = fraction
        fields["next_bound"] = dp.next_bound(bound, fraction, policy.adaptive)
    if policy.metrics_noise_multiplier > 0:
        counts = np.concatenate([totals.example_histogram, totals.clip_counts, [examples]]).astype(np.float64)
        noised = counts + dp.gaussian_noise(counts.size, plan.metrics_noise_stddev, key_stats)
        b, k = totals.example_histogram.size, totals.clip_counts.size
        fields["example_norm_histogram"] = noised[:b].tolist()
        fields["layer_clipped"] = noised[b:b + k].tolist()
        fields["examples"] = float(noised[-1])
    return Release(fields, sums), seen


def warm_up_in_background() -> threading.Thread:
    """:func:`clipd.engine._privacy.warm_up` on a thread of its own (started; a failure is logged: the first private
    release then loads what it needs itself)."""
    def warm() -> None:
        started = time.perf_counter()
        try:
            dp.warm_up()
        except Exception:
            log.exception("warming up the privacy accountant")
            return
        log.debug("privacy accountant loaded in %.2f s", time.perf_counter() - started)

    thread = threading.Thread(target=warm, name="clipd-privacy-warm-up", daemon=True)
    thread.start()
    return thread
