"""A ledger's canary audit on the server: its state in the store, its canaries in each release, its close.

The math is ``engine._audit``'s. Here, per release of an audited ledger (under the ledger's lock,
:class:`~clipd.server.privacy.Ledgers`):

1. :func:`canaries_for` says which canaries the release draws, their vectors at its bounds, and what a correct
   clip of each adds (computed from its vector and the bounds, never by the clipping code);
2. :func:`canaries_added` sends the drawn held-in ones through the aggregation's own unit, clip and step
   (:func:`clipd.server.canaries.clip_and_sum`) and holds what that added in the raw sums (in place; it yields
   the raw values at every canary's coordinates) while the release is noised as any other; then
   :func:`take_canaries` (or the noise on the device, :func:`by_layer`) takes out what a correct clip adds,
   and every canary's projection on the release as noised comes back;
3. :meth:`AuditState.record` adds the release to the audit (``O(N)``: scores, or a stream's decorrelation
   memory), and the state is committed with the release.

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

from clipd.engine import Unit
from clipd.engine import _audit as audit
from clipd.engine import _container as container
from clipd.engine import _privacy as dp
from clipd.engine import _sampling as sampling
from clipd.engine._correlated import CorrelatedNoise
from clipd.server.aggregations import Aggregation
from clipd.server.canaries import clip_and_sum
from clipd.server.stores.base import AuditRecord

AUDIT_MAGIC = b"CLIPDAU2"  # a ledger's audit state in clipd's container format (engine._container)
LEGACY_AUDIT_MAGIC = b"CLIPDAU1"  # the audits of canaries on a coordinate each, beside the clip (read; closed)
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
    """What the store keeps of a ledger's audit: ``O(N)`` whatever the number of releases."""

    seed: int
    canaries: int
    confidence: float
    releases: int = 0  # the ledger's releases the canaries were drawn for: its first ``releases``
    scores: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))  # independent noise: each
    # canary's score so far (2N,)
    stream: audit.StreamScoring | None = None  # a correlated stream's scoring (from its first release)
    result: dict | None = None  # once closed: claimed, lower bound, ceiling, refuted, the final scores
    legacy: dict | None = None  # an audit of the format before (its canaries beside the clip): closed as it is

    @classmethod
    def new(cls, policy: dp.PrivacyPolicy) -> AuditState:
        assert policy.audit is not None
        return cls(audit_seed(policy), policy.audit.canaries, policy.audit.confidence,
                   scores=np.zeros(2 * policy.audit.canaries))

    @property
    def closed(self) -> bool:
        return self.result is not None

    @property
    def takes_releases(self) -> bool:
        """Open, and of this format: the ledger's next release carries its canaries."""
        return not self.closed and self.legacy is None

    def to_bytes(self) -> bytes:
        header = {"seed": self.seed, "canaries": self.canaries, "confidence": self.confidence,
                  "releases": self.releases, "result": self.result, "stream": self.stream is not None}
        arrays = [("scores", self.scores)]
        if self.stream is not None:
            arrays += [(f"stream/{name}", getattr(self.stream, name))
                       for name in ("observed", "signal", "dot", "square")]
        return container.to_bytes(AUDIT_MAGIC, header, arrays)

    def record_of(self) -> AuditRecord:
        """What the store keeps of it."""
        return AuditRecord(self.to_bytes(), self.closed)

    @classmethod
    def from_bytes(cls, blob: bytes) -> AuditState:
        if bytes(blob[:len(LEGACY_AUDIT_MAGIC)]) == LEGACY_AUDIT_MAGIC:
            header, arrays = container.from_bytes(blob, LEGACY_AUDIT_MAGIC, "ledger audit")
            return cls(int(header["seed"]), int(header["canaries"]), float(header["confidence"]),
                       int(header["releases"]), arrays["scores"], result=header["result"],
                       legacy={"projections": arrays["projections"], "magnitudes": arrays["magnitudes"]})
        header, arrays = container.from_bytes(blob, AUDIT_MAGIC, "ledger audit")
        stream = None
        if header["stream"]:
            stream = audit.StreamScoring(*(arrays[f"stream/{name}"] for name in ("observed", "signal", "dot",
                                                                                  "square")))
        return cls(int(header["seed"]), int(header["canaries"]), float(header["confidence"]),
                   int(header["releases"]), arrays["scores"], stream, header["result"])

    def record(self, canaries: Canaries, projections: np.ndarray, stddev: float,
               stream: CorrelatedNoise | None = None, release: int = 0) -> None:
        """Adds one release: its canaries' projections, under noise of ``stddev`` per coordinate; on a
        correlated ``stream`` (its release ``release``, 0-based), decorrelated by its strategy."""
        if stream is None:
            share = audit.independent_scores(projections, canaries.magnitudes, canaries.rate, stddev)
            if canaries.scored is not None:
                share = np.where(canaries.scored, share, 0.0)
            self.scores = self.scores + share
        else:
            if self.stream is None:
                self.stream = audit.StreamScoring.new(stream.state_rows, 2 * self.canaries)
            layout = canaries.layout
            signal = canaries.magnitudes * audit.stream_participation(layout.starts, release, stream.min_separation,
                                                                      stream.max_participations)
            self.stream.add(stream.strategy_matrix(), projections, signal)
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
        if self.legacy is not None:
            return _legacy_stream_scores(self, stream, sigma)
        if self.stream is None:
            return np.zeros(2 * self.canaries)
        return self.stream.scores(sigma)

    def layout(self, sizes: Sequence[int], min_separation: int = 1) -> audit.CanaryLayout:
        """The canaries in a model of layers of ``sizes`` parameters."""
        return audit.canary_layout(self.seed, self.canaries, sizes, min_separation)

    def describe(self, claimed_now: float, delta: float) -> dict:
        """The audit as the fields of the proto ``LedgerAudit``: while open, its size and progress only."""
        described = {"canaries": self.canaries, "confidence": self.confidence, "closed": self.closed,
                     "releases": self.releases, "method": METHOD, "epsilon_claimed": claimed_now,
                     "epsilon_ceiling": audit.epsilon_ceiling(self.canaries, self.confidence, delta)}
        if self.result is not None:
            described.update(self.result, seed=self.seed)
        return described


def _legacy_stream_scores(state: AuditState, stream: CorrelatedNoise, sigma: float) -> np.ndarray:
    """The scores of a stream audited in the format before (every release's projections kept, a canary of one
    coordinate, the same norm every release): ``(<C p, C y> - ||C p||^2 / 2) / sigma^2`` over its releases."""
    assert state.legacy is not None
    projections, magnitudes = state.legacy["projections"], state.legacy["magnitudes"]
    t = projections.shape[0]
    starts = audit.stream_starts(state.seed, state.canaries, stream.min_separation)
    participation = np.stack([audit.stream_participation(starts, r, stream.min_separation,
                                                         stream.max_participations) for r in range(t)], axis=1)
    coefs = stream.strategy_matrix().coefs(t)
    lag = np.subtract.outer(np.arange(t), np.arange(t))
    c = np.where(lag >= 0, coefs[np.clip(lag, 0, None)], 0.0)
    signal, observed = (participation * magnitudes[:, None]) @ c.T, projections.T @ c.T
    return ((signal * observed).sum(axis=1) - (signal ** 2).sum(axis=1) / 2) / sigma ** 2


@dataclasses.dataclass(frozen=True)
class Canaries:
    """The canaries of one release: where they are, their vectors, what a correct clip of each adds (and its
    norm), and which are added (held in and drawn for this release)."""

    layout: audit.CanaryLayout
    vectors: audit.CanaryVectors
    clipped: tuple[np.ndarray, ...]  # per layer, per member: what a correct clip adds (float64)
    magnitudes: np.ndarray  # float64 (2N,): the norm of each canary's correct clip
    added: np.ndarray  # bool (2N,)
    rate: float = 1.0  # the probability that a canary is drawn for an independent release (its sampling rate)
    scored: np.ndarray | None = None  # bool (2N,): the canaries this release scores (participation limits:
    # those taking part, known to the auditor as the claim allows); None: every canary

    def taken_out(self, k: int) -> np.ndarray:
        """Layer ``k``: what the release takes out at each member's coordinate (0 where it was not added)."""
        return np.where(self.added[self.layout.members[k]], self.clipped[k], 0.0)


def canaries_for(state: AuditState, aggregation: Aggregation, release: int) -> Canaries:
    """The canaries of the ledger's release ``release`` (1-based) made by ``aggregation``: drawn by its sampling
    (the caller's rate, or the server's draws) under independent noise, or by their participation in the
    stream; their vectors and correct clips at the aggregation's bounds."""
    policy, privacy, layers = aggregation.policy, aggregation.privacy, aggregation.layers
    sizes = [layer.size for layer in layers]
    stream, limited = privacy.correlated, privacy.participation
    layout = state.layout(sizes, stream.min_separation if stream is not None
                          else limited.min_separation if limited is not None else 1)
    bounds = audit.layer_bounds(policy.kind.value, policy.l2_norm_clip, sizes, policy.layer_clips)
    vectors = audit.canary_vectors(layout, bounds, [layer.dtype for layer in layers], aggregation.unit is Unit.CLIENT)
    plan = aggregation.plan
    assert plan is not None  # (a private aggregation's)
    clipped, magnitudes = audit.clipped_as_specified(layout, vectors.values, bounds, plan.grid_step)
    rate, scored = 1.0, None
    if stream is not None:
        drawn = audit.stream_participation(layout.starts, release - 1, stream.min_separation,
                                           stream.max_participations) > 0
    elif limited is not None:  # as often as a client may: k releases b apart from its start, scored on those
        drawn = scored = audit.stream_participation(layout.starts, release - 1, limited.min_separation,
                                                    limited.max_participations) > 0
    else:
        rate = sampling_rate(privacy.sampling)
        if privacy.sampling.drawn_by is dp.DrawnBy.SERVER:
            drawn = sampling.drawn(audit.draw_key(state.seed), privacy.ledger_id, release,
                                   audit.canary_identities(layout.count), rate)
        else:
            drawn = audit.drawn_for_release(state.seed, release, layout.count, rate)
    return Canaries(layout, vectors, clipped, magnitudes, drawn & layout.held_in, rate, scored)


def sampling_rate(sampling: dp.Sampling) -> float:
    """The probability that one unit is in a release: 1 without sampling."""
    if sampling.kind is dp.SamplingKind.POISSON:
        return sampling.rate
    if sampling.kind is dp.SamplingKind.FIXED_SIZE:
        return sampling.sample_size / sampling.population
    return 1.0


@contextlib.contextmanager
def canaries_added(sums: list[np.ndarray], canaries: Canaries | None,
                   aggregation: Aggregation) -> Iterator[tuple[np.ndarray, ...] | None]:
    """While it lasts, the held-in canaries drawn are in ``sums`` (float64, in place; a layer that can't be
    written is copied into the list) as the aggregation's unit, clip and step add them; yields the raw values
    at every canary's coordinates, per layer, per member (None without canaries). The raw values are put back
    after, exactly, whatever happened."""
    if canaries is None:
        yield None
        return
    through = clip_and_sum(aggregation, canaries.layout, canaries.vectors, canaries.added)
    positions = canaries.layout.positions
    raw: list[np.ndarray] = []
    try:
        for k, (index, value) in enumerate(zip(positions, through)):
            layer = sums[k]
            if not (isinstance(layer, np.ndarray) and layer.flags.writeable):
                layer = sums[k] = np.array(layer, np.float64)
            raw.append(np.take(layer, index).astype(np.float64))
            np.put(layer, index, raw[k] + value)
        yield tuple(raw)
    finally:
        for k, values in enumerate(raw):
            np.put(sums[k], positions[k], values)


def by_layer(canaries: Canaries) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer: the flat indices of every canary there and what a correct clip added (0 if nothing), which
    the noise function subtracts on the device (:func:`clipd.engine._privacy.add_gaussian_noise`'s ``minus``).
    The same indices every release: one compiled program per ledger, whichever canaries a release drew."""
    return [(index, canaries.taken_out(k)) for k, index in enumerate(canaries.layout.positions)]


def projections(released: Sequence[np.ndarray], canaries: Canaries, raw: Sequence[np.ndarray],
                taken_out: bool) -> np.ndarray:
    """Each canary's projection on the release as noised, canaries in, beyond the raw sum: read off
    ``released``, plus the correct clips where they are ``taken_out`` of it already."""
    seen = []
    for k, index in enumerate(canaries.layout.positions):
        value = np.take(released[k], index).astype(np.float64)
        if taken_out:
            value = value + canaries.taken_out(k)
        seen.append(value - raw[k])
    return audit.projections(canaries.layout, seen, canaries.clipped, canaries.magnitudes)


def take_canaries(noised: Sequence[np.ndarray], canaries: Canaries,
                  raw: Sequence[np.ndarray]) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The noised sums without the canaries' correct clips (on the host), and each canary's projection on them."""
    seen = projections(noised, canaries, raw, taken_out=False)
    out = list(noised)
    for k, index in enumerate(canaries.layout.positions):
        layer = out[k] = _writable(out[k])
        np.put(layer, index, np.take(layer, index).astype(np.float64) - canaries.taken_out(k))
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
