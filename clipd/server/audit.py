"""A ledger's canary audit on the server: its state in the store, its canaries in each release, its close.

The math is ``engine._audit``'s. Here, per release of an audited ledger (under the ledger's lock,
:class:`~clipd.server.privacy.Ledgers`):

1. :func:`canaries_for` says which canaries the release is drawn for and their values;
2. :func:`canaries_added` holds the held-in ones in the raw sums (in place; it yields the raw values at every
   canary's coordinate) while the release is noised as any other; then :func:`take_canaries` (or the noise on
   the device, :func:`by_layer`) gives back the sums without the canaries, and every canary's projection on
   the release as noised;
3. :meth:`AuditState.record` adds the release to the audit, and the state is committed with the release.

The seed and the scores never leave the server while the audit is open; :meth:`AuditState.close` computes the
bound and keeps the result (a correlated stream's audit closes by itself with its last release).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import secrets
from collections.abc import Iterator, Sequence

import numpy as np

from clipd.engine import _audit as audit
from clipd.engine import _container as container
from clipd.engine import _privacy as dp
from clipd.engine._correlated import CorrelatedNoise
from clipd.server.stores.base import AuditRecord

AUDIT_MAGIC = b"CLIPDAU1"  # a ledger's audit state in clipd's container format (engine._container)
METHOD = "clopper_pearson"


def audit_seed(policy: dp.PrivacyPolicy) -> int:
    """A new audit's secret seed: 63 bits of the OS's CSPRNG; a seeded (test) policy's is derived from its seed
    and ledger, so a test's audit is reproducible, like its noise."""
    if policy.seed is None:
        return secrets.randbits(63)
    digest = hashlib.sha256(f"clipd-audit/{policy.seed}/{policy.ledger_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclasses.dataclass
class AuditState:
    """What the store keeps of a ledger's audit."""

    seed: int
    canaries: int
    confidence: float
    releases: int = 0  # the ledger's releases the canaries were drawn for: its first ``releases``
    scores: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))  # independent noise: each
    # canary's score so far (2N,)
    projections: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0)))  # a correlated stream:
    # every release's projections (releases, 2N)
    magnitudes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))  # a stream: each canary's norm
    result: dict | None = None  # once closed: claimed, lower bound, ceiling, refuted, the final scores

    @classmethod
    def new(cls, policy: dp.PrivacyPolicy) -> AuditState:
        assert policy.audit is not None
        n = 2 * policy.audit.canaries
        return cls(audit_seed(policy), policy.audit.canaries, policy.audit.confidence, scores=np.zeros(n),
                   projections=np.zeros((0, n)), magnitudes=np.zeros(n))

    @property
    def closed(self) -> bool:
        return self.result is not None

    def to_bytes(self) -> bytes:
        header = {"seed": self.seed, "canaries": self.canaries, "confidence": self.confidence,
                  "releases": self.releases, "result": self.result}
        return container.to_bytes(AUDIT_MAGIC, header, [("scores", self.scores), ("projections", self.projections),
                                                        ("magnitudes", self.magnitudes)])

    def record_of(self) -> AuditRecord:
        """What the store keeps of it."""
        return AuditRecord(self.to_bytes(), self.closed)

    @classmethod
    def from_bytes(cls, blob: bytes) -> AuditState:
        header, arrays = container.from_bytes(blob, AUDIT_MAGIC, "ledger audit")
        return cls(int(header["seed"]), int(header["canaries"]), float(header["confidence"]),
                   int(header["releases"]), arrays["scores"], arrays["projections"], arrays["magnitudes"],
                   header["result"])

    def record(self, canaries: Canaries, projections: np.ndarray, stddev: float, stream: bool) -> None:
        """Adds one release: its canaries' projections, under noise of ``stddev`` per coordinate (a stream's:
        its sigma)."""
        if stream:
            self.projections = np.vstack([self.projections, projections[None, :]])
            self.magnitudes = canaries.magnitudes
        else:
            self.scores = self.scores + audit.independent_scores(projections, canaries.magnitudes, canaries.rate,
                                                                 stddev)
        self.releases += 1

    def close(self, delta: float, stream: CorrelatedNoise | None, sigma: float, claimed: float) -> None:
        """Closes the audit over the releases it has, against ``claimed``, the ledger's epsilon over them, at
        ``delta``; ``stream`` and its ``sigma``: a correlated ledger's."""
        if self.closed:
            return
        scores = self.final_scores(stream, sigma)
        n = self.canaries
        lower = audit.epsilon_lower_bound(scores[:n], scores[n:], self.confidence, delta)
        self.result = {"epsilon_claimed": claimed, "epsilon_lower": lower,
                       "epsilon_ceiling": audit.epsilon_ceiling(n, self.confidence, delta),
                       "refuted": bool(lower > claimed), "in_scores": scores[:n].tolist(),
                       "out_scores": scores[n:].tolist()}

    def final_scores(self, stream: CorrelatedNoise | None, sigma: float) -> np.ndarray:
        if stream is None:
            return self.scores
        t = self.releases
        starts = audit.stream_starts(self.seed, self.canaries, stream.min_separation)
        participation = audit.stream_participation(starts, t, stream.min_separation, stream.max_participations)
        return audit.stream_scores(self.projections, self.magnitudes, participation,
                                   stream.strategy_matrix().coefs(t), sigma)

    def layout(self, dimension: int, min_separation: int = 1) -> audit.CanaryLayout:
        """The canaries in a model of ``dimension`` parameters."""
        return audit.canary_layout(self.seed, self.canaries, dimension, min_separation)

    def describe(self, claimed_now: float, delta: float) -> dict:
        """The audit as the fields of the proto ``LedgerAudit``: while open, its size and progress only."""
        described = {"canaries": self.canaries, "confidence": self.confidence, "closed": self.closed,
                     "releases": self.releases, "method": METHOD, "epsilon_claimed": claimed_now,
                     "epsilon_ceiling": audit.epsilon_ceiling(self.canaries, self.confidence, delta)}
        if self.result is not None:
            described.update(self.result, seed=self.seed)
        return described


@dataclasses.dataclass(frozen=True)
class Canaries:
    """The canaries of one release: every canary's coordinate, signed unit and norm, and whether it is added
    (held in and drawn for this release)."""

    coordinates: np.ndarray  # int64 (2N,)
    signs: np.ndarray  # float64 (2N,)
    magnitudes: np.ndarray  # float64 (2N,)
    added: np.ndarray  # bool (2N,)
    rate: float = 1.0  # the probability that a canary is drawn for an independent release (its sampling rate)

    @property
    def values(self) -> np.ndarray:
        """What each canary adds at its coordinate (0 where it is not added)."""
        return np.where(self.added, self.signs * self.magnitudes, 0.0)


def canaries_for(state: AuditState, policy: dp.PrivacyPolicy, plan: dp.ReleasePlan, layers: Sequence,
                 layer_bounds: Sequence[float], release: int) -> Canaries:
    """The canaries of the ledger's release ``release`` (1-based): drawn by its sampling rate (independent
    noise) or by their participation in the stream."""
    sizes = [layer.size for layer in layers]
    stream = policy.correlated
    layout = state.layout(sum(sizes), stream.min_separation if stream is not None else 1)
    count = 2 * state.canaries
    rate = 1.0
    if stream is not None:
        drawn = audit.stream_participation(layout.starts, release, stream.min_separation,
                                           stream.max_participations)[:, release - 1] > 0
    else:
        rate = sampling_rate(policy.sampling)
        drawn = audit.drawn_for_release(state.seed, release, count, rate)
    magnitudes = audit.magnitudes(layout.coordinates, layer_bounds, plan.grid_step)
    return Canaries(layout.coordinates, layout.signs, magnitudes, drawn & layout.held_in, rate)


def sampling_rate(sampling: dp.Sampling) -> float:
    """The probability that one unit is in a release: 1 without sampling."""
    if sampling.kind is dp.SamplingKind.POISSON:
        return sampling.rate
    if sampling.kind is dp.SamplingKind.FIXED_SIZE:
        return sampling.sample_size / sampling.population
    return 1.0


def _located(coordinates: np.ndarray, sums: Sequence[np.ndarray]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per layer that holds canaries: (layer, which canaries, their flat index in the layer)."""
    ends = np.cumsum([np.size(s) for s in sums])
    layer_of = np.searchsorted(ends, coordinates, side="right")
    out = []
    for k in np.unique(layer_of):
        which = np.flatnonzero(layer_of == k)
        start = ends[k - 1] if k else 0
        out.append((int(k), which, coordinates[which] - start))
    return out


@contextlib.contextmanager
def canaries_added(sums: list[np.ndarray], canaries: Canaries | None) -> Iterator[np.ndarray | None]:
    """While it lasts, the held-in canaries are in ``sums`` (float64, in place; a layer that can't be written is
    copied into the list); yields the raw value at every canary's coordinate (None without canaries). The raw
    values are put back after, exactly, whatever happened."""
    if canaries is None:
        yield None
        return
    raw = np.zeros(canaries.coordinates.size)
    values, added = canaries.values, []
    try:
        for k, which, index in _located(canaries.coordinates, sums):
            layer = sums[k]
            if not (isinstance(layer, np.ndarray) and layer.flags.writeable):
                layer = sums[k] = np.array(layer, np.float64)
            raw[which] = np.take(layer, index)
            np.put(layer, index, raw[which] + values[which])
            added.append((k, which, index))
        yield raw
    finally:
        for k, which, index in added:
            np.put(sums[k], index, raw[which])


def by_layer(canaries: Canaries, sums: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer of ``sums``: the flat indices of every canary there and what it added (0 if nothing), which the
    noise function subtracts on the device (:func:`clipd.engine._privacy.add_gaussian_noise`'s ``minus``). The
    same indices every release: one compiled program per ledger, whichever canaries a release drew."""
    out = [(np.zeros(0, np.int64), np.zeros(0)) for _ in sums]
    values = canaries.values
    for k, which, index in _located(canaries.coordinates, sums):
        out[k] = (index, values[which])
    return out


def projections(released: Sequence[np.ndarray], canaries: Canaries, raw: np.ndarray, taken_out: bool) -> np.ndarray:
    """Each canary's projection ``sign * (noised - raw)`` on the release as noised, canaries in: read off
    ``released``, plus the canaries where they are ``taken_out`` of it already."""
    noised = np.zeros(canaries.coordinates.size)
    for k, which, index in _located(canaries.coordinates, released):
        noised[which] = np.take(released[k], index).astype(np.float64)
    if taken_out:
        noised += canaries.values
    return canaries.signs * (noised - raw)


def take_canaries(noised: Sequence[np.ndarray], canaries: Canaries,
                  raw: np.ndarray) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The noised sums without the canaries (on the host), and each canary's projection on them."""
    seen = projections(noised, canaries, raw, taken_out=False)
    out = list(noised)
    values = canaries.values
    for k, which, index in _located(canaries.coordinates, out):
        layer = out[k] = _writable(out[k])
        np.put(layer, index, np.take(layer, index).astype(np.float64) - values[which])
    return tuple(out), seen


def _writable(array: np.ndarray) -> np.ndarray:
    """``array`` itself, made writable where numpy allows it (a fresh host copy that a device transfer marked
    read-only); else a copy."""
    if array.flags.writeable:
        return array
    try:
        array.setflags(write=True)
        return array
    except ValueError:
        return np.array(array)
