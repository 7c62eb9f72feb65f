"""Differential privacy of a release: sensitivity, noise, adaptive clipping and accounting.

The math of docs/privacy.md as small functions; the accounting itself is
``dp_accounting``'s (RDP, PLD or zCDP), never ours.

A release of an aggregation is the Gaussian mechanism on the clipped sum: each
contribution is clipped to the example bound ``C`` (``sqrt(sum C_k^2)`` with
per-layer bounds), so the sum moves by at most the *sensitivity* ``C`` when
one contribution is added or removed, ``2C`` when one is replaced. Noise of
stddev ``z * sensitivity`` per coordinate makes it a Gaussian mechanism with
noise multiplier ``z``. Optional companions share the same release, each a
Gaussian with its own multiplier ``z_j``; the value's multiplier ``z_v`` is
chosen so that the release as a whole keeps the total ``z``:
``z_v^-2 = z^-2 - sum z_j^-2``. The companions:

- the count of unclipped contributions of adaptive clipping (Andrew et al.
  2021), centred (each contributes ``1{norm <= C} - 1/2``), noised with stddev
  ``sigma_b``; its sensitivity is 1/2 (add/remove) or 1 (replace), so its
  multiplier is ``2 sigma_b`` (add/remove) or ``sigma_b`` (replace);
- the released statistics: the example-norm histogram, the per-layer clip
  counts and the number of contributions as one vector, noised with
  ``z_m * sensitivity`` (see :func:`statistics_sensitivity`).

Example (TF Privacy's split, ``z = 1``, ``sigma_b = 1``):

  >>> round(value_noise_multiplier(1.0, [2.0]), 6)
  1.154701
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import json
import math
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _secure_noise as secure
from ._audit import CanaryAudit
from ._correlated import CorrelatedNoise

if TYPE_CHECKING:  # imported where they are used: dp_accounting (and the scipy it loads, ~0.8 s of a process's
    import dp_accounting  # start) comes with the first privacy policy or ledger, never to a server or shard
    from dp_accounting import dp_event as dpe  # process that aggregates without privacy

PLD_DISCRETIZATION = 1e-4  # value_discretization_interval of the PLD accountant


class Neighbouring(str, enum.Enum):
    """Which datasets are neighbours: the unit whose influence is bounded."""

    ADD_REMOVE_ONE = "add_remove_one"
    REPLACE_ONE = "replace_one"


class Accountant(str, enum.Enum):
    RDP = "rdp"  # dp_accounting.rdp.RdpAccountant with its default orders
    PLD = "pld"  # dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    ZCDP = "zcdp"  # OpenDP: rho-zCDP added up, converted to epsilon by OpenDP (the secure noise's)


class Noise(str, enum.Enum):
    """What the noise of a release is drawn as."""

    GAUSSIAN = "gaussian"  # JAX's float32 normal, from a key of 64 bits of the OS's CSPRNG
    SECURE = "secure"  # the sum on an integer grid plus OpenDP's discrete Gaussian (_secure_noise)


class SamplingKind(str, enum.Enum):
    NONE = "none"  # every release sees the whole dataset
    POISSON = "poisson"  # each unit joins a release independently with probability `rate`
    FIXED_SIZE = "fixed_size"  # `sample_size` units drawn without replacement from `population`


class DrawnBy(str, enum.Enum):
    """Who draws a release's sample: the caller (its promise, which the server accounts for) or the server (a
    keyed coin of its own, ``engine._sampling``; a unit it did not draw is refused)."""

    CALLER = "caller"
    SERVER = "server"


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the units of one release were drawn (it amplifies privacy): by the caller, on its word, or by the
    server (``drawn_by="server"``, Poisson only)."""

    kind: SamplingKind = SamplingKind.NONE
    rate: float = 0.0
    population: int = 0
    sample_size: int = 0
    drawn_by: DrawnBy = DrawnBy.CALLER

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SamplingKind(self.kind))
        object.__setattr__(self, "drawn_by", DrawnBy(self.drawn_by))
        if self.drawn_by is DrawnBy.SERVER and self.kind is not SamplingKind.POISSON:
            raise ValueError(f"the server draws Poisson samples only (sampling poisson with a rate), not"
                             f" {self.kind.value}")
        if self.kind is SamplingKind.POISSON and not 0.0 < self.rate <= 1.0:
            raise ValueError(f"Poisson sampling needs a rate in (0, 1], got {self.rate}")
        if self.kind is SamplingKind.FIXED_SIZE and not 0 < self.sample_size <= self.population:
            raise ValueError(f"fixed-size sampling needs 0 < sample_size <= population, got"
                             f" {self.sample_size} of {self.population}")

    def wrap(self, event: dpe.DpEvent) -> dpe.DpEvent:
        """The event of ``event`` run on a sample drawn this way."""
        from dp_accounting import dp_event as dpe
        if self.kind is SamplingKind.POISSON:
            return dpe.PoissonSampledDpEvent(self.rate, event)
        if self.kind is SamplingKind.FIXED_SIZE:
            return dpe.SampledWithoutReplacementDpEvent(self.population, self.sample_size, event)
        return event


@dataclasses.dataclass(frozen=True)
class Participation:
    """How often one unit (a client identity) may take part in a ledger's releases, with independent noise: at
    most ``max_participations`` (k) releases, at least ``min_separation`` (b) apart. Its epsilon is then that
    of k' Gaussian releases (:func:`participation_event`), whatever the number of releases; the server enforces
    it per client identity, on credentials (asynchronous clients are not sampled: this is their privacy).

    >>> Participation(min_separation=10, max_participations=3).most(100)
    3
    """

    min_separation: int = 1
    max_participations: int = 1

    def __post_init__(self) -> None:
        if self.min_separation < 1 or self.max_participations < 1:
            raise ValueError(f"participation: min_separation and max_participations are >= 1, got"
                             f" {self.min_separation} and {self.max_participations}")

    def most(self, releases: int) -> int:
        """The most of ``releases`` releases one unit can take part in: min(k, ceil(n / b))."""
        return min(self.max_participations, -(-releases // self.min_separation))


def participation_event(event_json: str, releases: int, participation: Participation) -> str:
    """The ledger entry of a participation-limited ledger's ``releases``-th release: each release's event
    composed as many times as one unit can have taken part in so far (the ledger's epsilon is that entry's
    alone).

    >>> participation_event('{"class_name": "NonPrivateDpEvent", "module_name": "dp_accounting.dp_event"}', 5,
    ...                     Participation(1, 2))
    '{"class_name": "NonPrivateDpEvent", "module_name": "dp_accounting.dp_event"}'
    """
    return _self_composed(event_json, participation.most(releases))


@functools.lru_cache(maxsize=256)
def _self_composed(event_json: str, count: int) -> str:
    """``event_json`` composed ``count`` times, as JSON (a ledger asks for the same few at each release)."""
    event = event_from_json(event_json)
    from dp_accounting import dp_event as dpe

    if isinstance(event, dpe.NonPrivateDpEvent):
        return event_json
    return event_to_json(dpe.SelfComposedDpEvent(event, count))


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
    """Andrew et al.'s quantile-tracking bound, as TF Privacy's ``QuantileAdaptiveClipSumQuery``.

    After each release ``C <- clamp(C * exp(-lr * (b_hat - target)), min, max)``,
    where ``b_hat`` is the noised fraction of contributions whose norm was at
    most ``C`` (not clipped), normalized by the public denominator.
    """

    target_unclipped_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float = 0.0  # sigma_b: stddev of the noise on the centred count
    initial_bound: float = 0.1
    min_bound: float = 0.0
    max_bound: float = math.inf
    geometric_update: bool = True  # False: TF Privacy's arithmetic rule C - lr * (b_hat - target)

    def __post_init__(self) -> None:
        if not 0.0 <= self.target_unclipped_quantile <= 1.0:
            raise ValueError(f"target_unclipped_quantile must be in [0, 1], got {self.target_unclipped_quantile}")
        if not (self.learning_rate >= 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be finite and >= 0, got {self.learning_rate}")
        if not self.count_stddev >= 0:
            raise ValueError(f"count_stddev must be >= 0, got {self.count_stddev}")
        if not 0.0 <= self.min_bound <= self.initial_bound <= self.max_bound or not math.isfinite(self.initial_bound):
            raise ValueError("adaptive clipping needs 0 <= min_bound <= initial_bound <= max_bound, initial finite;"
                             f" got {self.min_bound}, {self.initial_bound}, {self.max_bound}")


def sensitivity(example_bound: float, neighbouring: Neighbouring) -> float:
    """L2 sensitivity of a sum of contributions clipped to ``example_bound``.

    >>> sensitivity(1.5, Neighbouring.ADD_REMOVE_ONE), sensitivity(1.5, Neighbouring.REPLACE_ONE)
    (1.5, 3.0)
    """
    return example_bound * (2.0 if Neighbouring(neighbouring) is Neighbouring.REPLACE_ONE else 1.0)


def count_sensitivity(neighbouring: Neighbouring) -> float:
    """Of the centred count of unclipped contributions: 1/2 (add/remove one), 1 (replace one)."""
    return 1.0 if Neighbouring(neighbouring) is Neighbouring.REPLACE_ONE else 0.5


def statistics_sensitivity(layers: int, neighbouring: Neighbouring) -> float:
    """L2 sensitivity of the statistics vector (histogram, per-layer clip counts, count).

    One contribution adds 1 to one histogram bucket, at most 1 to each of the
    ``layers`` clip counts and 1 to the count: ``sqrt(1 + K + 1)``. Replacing
    one moves two buckets by 1, each clip count by at most 1 and the count not
    at all: ``sqrt(2 + K)``. Both are ``sqrt(K + 2)``.

    >>> statistics_sensitivity(2, Neighbouring.ADD_REMOVE_ONE)
    2.0
    """
    return math.sqrt(layers + 2.0)


def value_noise_multiplier(total: float, companions: Sequence[float]) -> float:
    """``z_v`` with ``z_v^-2 = z^-2 - sum z_j^-2``: the release keeps the total ``z``.

    ``total = 0`` means no noise at all (0). ``ValueError`` if the companions
    alone already spend the whole budget of ``total``.
    """
    if total == 0:
        return 0.0
    rest = total ** -2 - sum(z ** -2 for z in companions if z > 0)
    if rest <= 0:
        raise ValueError(f"the companion noise multipliers {list(companions)} leave nothing of the total"
                         f" z = {total}: raise count_stddev / metrics_noise_multiplier, or raise z")
    return rest ** -0.5


def release_event(value_z: float, companions: Sequence[float], sampling: Sampling) -> dpe.DpEvent:
    """The DpEvent of one release: the value's Gaussian and its companions', under the sampling."""
    from dp_accounting import dp_event as dpe
    gaussians = [dpe.GaussianDpEvent(value_z), *(dpe.GaussianDpEvent(z) for z in companions)]
    inner = gaussians[0] if len(gaussians) == 1 else dpe.ComposedDpEvent(gaussians)
    return sampling.wrap(inner)


def _collapse_gaussians(event: dpe.DpEvent) -> dpe.DpEvent:
    """Composed Gaussians as one with ``z = (sum z_i^-2)^(-1/2)`` (the same privacy loss); PLD needs it."""
    from dp_accounting import dp_event as dpe
    if isinstance(event, dpe.PoissonSampledDpEvent):
        return dpe.PoissonSampledDpEvent(event.sampling_probability, _collapse_gaussians(event.event))
    if isinstance(event, dpe.ComposedDpEvent):
        parts = [_collapse_gaussians(e) for e in event.events]
        if parts and all(isinstance(p, dpe.GaussianDpEvent) for p in parts):
            if any(p.noise_multiplier == 0 for p in parts):
                return dpe.GaussianDpEvent(0.0)
            return dpe.GaussianDpEvent(sum(p.noise_multiplier ** -2 for p in parts) ** -0.5)
        return dpe.ComposedDpEvent(parts)
    if isinstance(event, dpe.SelfComposedDpEvent):
        return dpe.SelfComposedDpEvent(_collapse_gaussians(event.event), event.count)
    return event


def make_accountant(accountant: Accountant, neighbouring: Neighbouring) -> dp_accounting.PrivacyAccountant:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    relation = (dp_accounting.NeighboringRelation.REPLACE_ONE if Neighbouring(neighbouring) is Neighbouring.REPLACE_ONE
                else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    if Accountant(accountant) is Accountant.PLD:
        return pld_privacy_accountant.PLDAccountant(relation, value_discretization_interval=PLD_DISCRETIZATION)
    return rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)


def warm_up() -> None:
    """Loads what a first private release waits for, so that it need not: dp_accounting with its RDP and PLD
    accountants (and the scipy they import: about 3 s of a 2-core machine), and the release keys' program
    (:func:`release_keys`, the same for every release). A server calls it on a thread of its own once it serves.
    """
    make_accountant(Accountant.RDP, Neighbouring.ADD_REMOVE_ONE)
    make_accountant(Accountant.PLD, Neighbouring.ADD_REMOVE_ONE)
    release_keys(0, 0)
    release_keys(None, 0)


def check_supported(accountant: Accountant, neighbouring: Neighbouring, sampling: Sampling) -> None:
    """``ValueError`` for the combinations dp_accounting cannot account (or accounts differently)."""
    accountant, neighbouring = Accountant(accountant), Neighbouring(neighbouring)
    if accountant is Accountant.ZCDP and sampling.kind is not SamplingKind.NONE:
        raise ValueError("the zcdp accountant (secure noise) does not claim amplification by sampling: no vetted"
                         " accountant bounds the subsampled discrete Gaussian; use sampling none (a valid, larger"
                         " epsilon) or the default noise")
    if sampling.kind is SamplingKind.POISSON and neighbouring is not Neighbouring.ADD_REMOVE_ONE:
        raise ValueError("Poisson sampling is accounted under add/remove-one neighbours only")
    if sampling.kind is SamplingKind.FIXED_SIZE and neighbouring is not Neighbouring.REPLACE_ONE:
        raise ValueError("fixed-size sampling (without replacement) is accounted under replace-one neighbours only")
    if accountant is Accountant.PLD and neighbouring is Neighbouring.REPLACE_ONE:
        # PLDAccountant reads a GaussianDpEvent under REPLACE_ONE as add/remove sensitivity 1
        # (a replacement moves the sum by 2), RdpAccountant as replace sensitivity 1: clipd noises
        # for the replace sensitivity 2C, which only the RDP accountant reads right.
        raise ValueError("replace-one neighbours are accounted with RDP only (PLD reads the event's"
                         " noise multiplier against another sensitivity)")
    if accountant is Accountant.PLD and sampling.kind is SamplingKind.FIXED_SIZE:
        raise ValueError("the PLD accountant does not account fixed-size sampling; use RDP")


def epsilon(events: Sequence[dpe.DpEvent], delta: float, accountant: Accountant,
            neighbouring: Neighbouring) -> float:
    """Epsilon at ``delta`` of the composition of ``events`` (``inf`` with a non-private one)."""
    return epsilon_of_json([event_to_json(e) for e in events], delta, accountant, neighbouring)


def epsilon_of_json(events: Sequence[str], delta: float, accountant: Accountant, neighbouring: Neighbouring) -> float:
    """:func:`epsilon` of events as a ledger stores them (``event_to_json``)."""
    # Identical events (a ledger's rounds usually are) composed once with their count: the
    # same epsilon (RDP adds count * rdp, PLD self-composes), in time that does not grow with rounds.
    return epsilon_of_counts(collections.Counter(events), delta, accountant, neighbouring)


def epsilon_of_counts(counts: Mapping[str, int], delta: float, accountant: Accountant,
                      neighbouring: Neighbouring) -> float:
    """:func:`epsilon_of_json` of events given by their counts (``{event_json: how many}``): a ledger that keeps
    its counts as its events come asks for its epsilon in time that does not grow with its length.

    >>> from dp_accounting import dp_event as dpe
    >>> event = event_to_json(dpe.GaussianDpEvent(1.0))
    >>> epsilon_of_counts({event: 3}, 1e-5, "rdp", "add_remove_one") == epsilon_of_json([event] * 3, 1e-5, "rdp",
    ...                                                                                   "add_remove_one")
    True
    """
    counts = {text: count for text, count in counts.items() if count}
    if not counts:
        return 0.0
    if Accountant(accountant) is Accountant.ZCDP:
        return _zcdp_epsilon(tuple(sorted(counts.items())), float(delta))
    return _epsilon_of_counts(tuple(sorted(counts.items())), float(delta), Accountant(accountant),
                              Neighbouring(neighbouring))


@functools.lru_cache(maxsize=1024)
def _epsilon_of_counts(counts: tuple[tuple[str, int], ...], delta: float, accountant: Accountant,
                       neighbouring: Neighbouring) -> float:
    """Cached: a ledger's epsilon is asked at every creation, release and scrape, and changes only with it."""
    from dp_accounting.rdp import rdp_privacy_accountant

    if accountant is Accountant.RDP:
        # What RdpAccountant.compose(event, count) does for each event in turn (rdp += count * curve), with
        # each distinct event's curve computed once: a Poisson-sampled Gaussian's takes 50-80 ms, and a
        # trainer's ledger gains one release per step, each a new count.
        rdp = np.zeros(len(rdp_privacy_accountant.DEFAULT_RDP_ORDERS), np.float64)
        for text, count in counts:
            rdp += count * _rdp_curve(text, neighbouring)
        return float(rdp_privacy_accountant.compute_epsilon(rdp_privacy_accountant.DEFAULT_RDP_ORDERS, rdp, delta)[0])
    acc = make_accountant(accountant, neighbouring)
    for text, count in counts:
        event = event_from_json(text)
        acc.compose(_collapse_gaussians(event) if accountant is Accountant.PLD else event, count)
    return float(acc.get_epsilon(delta))


@functools.lru_cache(maxsize=1024)
def _zcdp_epsilon(counts: tuple[tuple[str, int], ...], delta: float) -> float:
    """Epsilon of secure releases: their rho added up (``count`` times each), converted by OpenDP."""
    if any(not secure.is_secure_event(text) for text, _ in counts):  # a debug entry (NonPrivateDpEvent)
        return math.inf
    return secure.epsilon_of_rho(sum(count * secure.release_rho(text) for text, count in counts), delta)


@functools.lru_cache(maxsize=256)
def _rdp_curve(event_json: str, neighbouring: Neighbouring) -> np.ndarray:
    """One event's RDP at each of the RDP accountant's default orders, as dp_accounting computes it."""
    acc = make_accountant(Accountant.RDP, neighbouring)
    acc.compose(event_from_json(event_json))
    curve = np.array(acc._rdp, np.float64)  # dp_accounting (pinned < 0.7) keeps the composed RDP here
    curve.setflags(write=False)
    return curve


def calibrate_noise_multiplier(target_epsilon: float, delta: float, releases: int, sampling: Sampling,
                               accountant: Accountant, neighbouring: Neighbouring) -> float:
    """The smallest total ``z`` whose ``releases`` releases, sampled so, spend ``target_epsilon`` at ``delta``."""
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon}")
    if releases < 1:
        raise ValueError("calibrating z needs planned_releases >= 1")
    if Accountant(accountant) is Accountant.ZCDP:
        return secure.noise_multiplier_for(target_epsilon, delta, releases)
    import dp_accounting
    from dp_accounting import dp_event as dpe

    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: make_accountant(accountant, neighbouring),
        lambda z: dpe.SelfComposedDpEvent(sampling.wrap(dpe.GaussianDpEvent(z)), releases),
        target_epsilon, delta))


def event_to_json(event: dpe.DpEvent) -> str:
    """The event as JSON (``to_named_tuple``'s fields, nested events as objects); the same event's JSON is made
    once (``to_named_tuple`` makes a class each time) where the event is hashable (frozen, no lists)."""
    try:
        return _event_json(repr(event), event)  # (the repr too: GaussianDpEvent(1) == GaussianDpEvent(1.0))
    except TypeError:  # (unhashable: a composition of a list of events)
        return json.dumps(_plain(event.to_named_tuple()), sort_keys=True)


@functools.lru_cache(maxsize=256)
def _event_json(_: str, event: dpe.DpEvent) -> str:
    return json.dumps(_plain(event.to_named_tuple()), sort_keys=True)


def event_from_json(text: str) -> dpe.DpEvent:
    from dp_accounting import dp_event as dpe

    return dpe.DpEvent.from_named_tuple(_named(json.loads(text)))


def _plain(value):
    if hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@functools.lru_cache(maxsize=64)
def _event_tuple(fields: tuple[str, ...]) -> type:
    """The named tuple type of one event's fields (made once: a class is slow to make)."""
    return collections.namedtuple("_Event", fields)


def _named(value):
    """JSON objects back into named tuples that ``DpEvent.from_named_tuple`` accepts."""
    if isinstance(value, dict):
        fields = {k: _named(v) for k, v in value.items()}
        return _event_tuple(tuple(fields))(**fields)
    if isinstance(value, list):
        return [_named(v) for v in value]
    return value


# Noise ------------------------------------------------------------------------------------
def fresh_key(seed: int | None = None) -> jax.Array:
    """A threefry key from 64 bits of the OS's CSPRNG (``secrets``), or from ``seed`` (tests only)."""
    bits = secrets.randbits(64) if seed is None else int(seed) % (1 << 64)
    # jax takes any uint32 array-like here (it converts); its annotation says jax.Array.
    return jax.random.wrap_key_data(np.array([bits >> 32, bits & 0xFFFFFFFF], dtype=np.uint32))  # type: ignore[arg-type]


def release_keys(seed: int | None, releases: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The three keys of one release (its sums', its count's, its statistics'): ``split(key, 3)`` of a
    :func:`fresh_key`, or of ``seed``'s key folded with ``releases`` (reproducible, yet no two releases of a
    ledger share noise), made in one dispatch (one at a time, the key, the fold and the split cost a DP-SGD step
    half a millisecond).

    >>> a, b, c = release_keys(7, 3)
    >>> key = jax.random.fold_in(fresh_key(7), 3)
    >>> all(bool((jax.random.key_data(x) == jax.random.key_data(y)).all())
    ...     for x, y in zip((a, b, c), jax.random.split(key, 3)))
    True
    """
    bits = secrets.randbits(64) if seed is None else int(seed) % (1 << 64)
    data = np.array([bits >> 32, bits & 0xFFFFFFFF], dtype=np.uint32)
    keys = _release_keys(data, np.uint32(releases % (1 << 32)), seed is not None)
    return keys[0], keys[1], keys[2]


@functools.partial(jax.jit, static_argnums=2)
def _release_keys(data: jax.Array, releases: jax.Array, seeded: bool) -> tuple[jax.Array, ...]:
    key = jax.random.wrap_key_data(data)
    if seeded:
        key = jax.random.fold_in(key, releases)
    return tuple(jax.random.split(key, 3))


def add_gaussian_noise(sums: Sequence[np.ndarray], stddev: float, key: jax.Array,
                       dtypes: Sequence[np.dtype], minus: Sequence[tuple[np.ndarray, np.ndarray]] | None = None
                       ) -> tuple[np.ndarray, ...]:
    """``sum_k + N(0, stddev^2)`` per coordinate, on the default device, in each layer's sum dtype.

    The noise is drawn in the sum dtype (float32 at least), one draw per group of layers
    (:func:`noise_groups`) from a subkey each, each layer a slice of its group's draw: no two
    coordinates (and, with a fresh key, no two releases) share noise.
    ``minus``: per layer, flat indices and the values subtracted from them after the noise, on the device
    (an audit's canaries, taken out of the release before it reaches the host).
    """
    values = tuple(np.asarray(total, dtype=np.promote_types(dtype, np.float32)) for total, dtype in zip(sums, dtypes))
    if stddev <= 0 and minus is None:
        return values
    if minus is None:
        return tuple(np.asarray(v) for v in jax.device_get(_noised(key, values, np.float64(stddev))))
    taken = tuple((np.asarray(index, np.int32 if v.size < 2 ** 31 else np.int64), np.asarray(value, v.dtype))
                  for (index, value), v in zip(minus, values))
    return tuple(np.asarray(v) for v in jax.device_get(_noised_minus(key, values, np.float64(stddev), taken)))


NOISE_GROUP = 1 << 24  # elements of one noise draw (64 MiB of float32): layers are drawn together up to this


def noise_groups(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[Any]) -> tuple[tuple[int, ...], ...]:
    """The layers drawn together: runs of consecutive layers of one dtype of at most ``NOISE_GROUP`` elements in
    all (a larger layer alone).

    One Gaussian draw costs XLA a third of a second to compile on a 2-core CPU, whatever its size: a draw per
    layer made a model of 64 layers wait 9 s for its first release, a draw per group 0.7 s. The bound keeps
    the draw's buffer beside the sums small for large models (whose large layers are drawn alone, as before).

    >>> noise_groups([(32, 64), (32,), (10, 32), (10,)], ["float32"] * 4)
    ((0, 1, 2, 3),)
    >>> noise_groups([(1 << 24,), (3,), (4,), (5,)], ["float32", "float32", "float64", "float64"])
    ((0,), (1,), (2, 3))
    """
    groups: list[list[int]] = []
    size, dtype = 0, None
    for k, (shape, kind) in enumerate(zip(shapes, dtypes)):
        n = math.prod(shape)
        if groups and np.dtype(kind) == dtype and size + n <= NOISE_GROUP:
            groups[-1].append(k)
            size += n
        else:
            groups.append([k])
            size, dtype = n, np.dtype(kind)
    return tuple(tuple(group) for group in groups)


@jax.jit
def _noised(key: jax.Array, values: tuple[jax.Array, ...], stddev: jax.Array) -> tuple[jax.Array, ...]:
    """One program for every layer (one dispatch per release), one draw per group of layers (:func:`noise_groups`,
    from the shapes: fixed when the program is traced)."""
    groups = noise_groups([v.shape for v in values], [v.dtype for v in values])
    keys = jax.random.split(key, max(1, len(groups)))
    noised: list[jax.Array] = [jnp.zeros(0)] * len(values)
    for g, group in enumerate(groups):
        dtype = values[group[0]].dtype
        draw = jax.random.normal(keys[g], (sum(values[k].size for k in group),), dtype=dtype) * stddev.astype(dtype)
        start = 0
        for k in group:
            noised[k] = values[k] + draw[start:start + values[k].size].reshape(values[k].shape)
            start += values[k].size
    return tuple(noised)


_PREPARED: set[tuple] = set()  # the layers whose noise program was compiled (or is being) ahead, in this process
_PREPARED_LOCK = threading.Lock()


def prepare_noise(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[Any]) -> None:
    """Compiles the release's noise program for layers of ``shapes`` whose sums have ``dtypes`` (as
    :func:`add_gaussian_noise` takes them) on a thread of its own, once per process and layers, from shapes alone:
    called as a private aggregation is made, so that its release finds it compiled (a DP-SGD trainer's first
    step compiles its sums' program meanwhile, on the other core). A release that comes while it is compiled
    waits for that compilation: JAX compiles a program once, whichever thread asks first."""
    layers = tuple((tuple(shape), np.dtype(np.promote_types(dtype, np.float32)))
                   for shape, dtype in zip(shapes, dtypes))
    with _PREPARED_LOCK:
        if layers in _PREPARED:
            return
        _PREPARED.add(layers)
    threading.Thread(target=_compile_noise, args=(layers,), name="clipd-noise-compile", daemon=True).start()


def _compile_noise(layers: tuple) -> None:
    """The noise program for ``layers`` (``(shape, dtype)`` of each, as the release passes them), compiled."""
    values = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in layers)
    try:
        _noised.lower(fresh_key(0), values, np.float64(1.0)).compile()
    except Exception:  # (the release compiles it itself, and says what fails)
        pass


@jax.jit
def _noised_minus(key: jax.Array, values: tuple[jax.Array, ...], stddev: jax.Array,
                  minus: tuple[tuple[jax.Array, jax.Array], ...]) -> tuple[jax.Array, ...]:
    """:func:`_noised`, then ``minus``'s values subtracted at its flat indices, layer by layer."""
    return tuple(v.ravel().at[index].add(-value).reshape(v.shape)
                 for v, (index, value) in zip(_noised(key, values, stddev), minus))


def gaussian_noise(n: int, stddev: float, key: jax.Array) -> np.ndarray:
    """``n`` float64 Gaussian draws of ``stddev`` (the statistics and the count), on the host."""
    if stddev == 0 or n == 0:
        return np.zeros(n)
    return np.asarray(jax.random.normal(key, (n,), dtype=jnp.float32), dtype=np.float64) * stddev


# Adaptive clipping ------------------------------------------------------------------------
def unclipped_fraction(noised_centred_count: float, denominator: float) -> float:
    """``b_hat = clamp(noised sum of (1{norm <= C} - 1/2) / denominator + 1/2, 0, 1)``."""
    return min(1.0, max(0.0, noised_centred_count / denominator + 0.5))


def next_bound(bound: float, fraction: float, rule: AdaptiveClipping) -> float:
    """The geometric update ``C * exp(-lr * (b_hat - target))``, clamped to ``[min, max]``.

    With ``geometric_update=False``, TF Privacy's arithmetic ``C - lr * (b_hat - target)``
    (never below 0).

    >>> round(next_bound(1.0, 1.0, AdaptiveClipping(0.5, 0.2, initial_bound=1.0)), 6)
    0.904837
    """
    step = fraction - rule.target_unclipped_quantile
    if rule.geometric_update:
        updated = bound * math.exp(-rule.learning_rate * step)
    else:
        updated = max(0.0, bound - rule.learning_rate * step)
    return min(rule.max_bound, max(rule.min_bound, updated))


# The policy of an aggregation ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PrivacyPolicy:
    """How an aggregation's clipped sum is released, and under which ledger it is accounted.

    Attributes:
      ledger_id: the ledger whose epsilon this release adds to (rounds, steps of one training).
      delta: epsilon is reported (and budgeted) at this delta.
      noise_multiplier: the total ``z`` (0: no noise, epsilon infinite); or None with
        ``target_epsilon`` and ``planned_releases``, from which ``z`` is calibrated.
      max_epsilon: the ledger's budget (``inf``: none).
      adaptive: adaptive clipping (GLOBAL bound only), or None for a fixed bound.
      public_denominator: the expected number of contributions (public): the mean
        divides by it and so does the adaptive rule's unclipped fraction.
      release_mean: release ``sum / public_denominator`` instead of the sum.
      metrics_noise_multiplier: ``z_m`` of the released statistics (0: none released).
      seed: draw the noise from this seed (tests only: not private, marked in the result).
      debug_raw_statistics: raw statistics visible while it runs; the ledger's epsilon becomes infinite.
      noise: ``gaussian`` (JAX's float normal) or ``secure`` (a discrete Gaussian on an integer grid,
        accounted by the ``zcdp`` accountant; no sampling, adaptive clipping, released statistics or seed).
      correlated: the ledger's releases share one correlated noise stream (DP-FTRL, ``engine._correlated``):
        the whole stream is one Gaussian mechanism of multiplier ``z`` (``target_epsilon`` calibrates it
        for that one event); None: each release has independent noise.
      audit: canaries that put an empirical lower bound beside the ledger's epsilon (``engine._audit``); the
        ledger's, from its first release on.
      participation: with independent noise, how often one unit may take part (:class:`Participation`): the
        server enforces it per client identity, and the ledger's epsilon is a unit's over the releases it can
        be in; None: no limit (every release may have every unit).
    """

    ledger_id: str
    delta: float
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    planned_releases: int = 0
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE_ONE
    sampling: Sampling = Sampling()
    accountant: Accountant = Accountant.RDP
    max_epsilon: float = math.inf
    adaptive: AdaptiveClipping | None = None
    public_denominator: float = 0.0
    release_mean: bool = False
    metrics_noise_multiplier: float = 0.0
    seed: int | None = None
    debug_raw_statistics: bool = False
    noise: Noise = Noise.GAUSSIAN
    correlated: CorrelatedNoise | None = None
    audit: CanaryAudit | None = None
    participation: Participation | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "neighbouring", Neighbouring(self.neighbouring))
        object.__setattr__(self, "accountant", Accountant(self.accountant))
        object.__setattr__(self, "noise", Noise(self.noise))
        if not self.ledger_id:
            raise ValueError("a privacy policy needs a ledger_id")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("set exactly one of noise_multiplier and target_epsilon")
        z = self.noise_multiplier
        if z is not None and not (z >= 0 and math.isfinite(z)):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier}")
        if self.target_epsilon is not None and self.planned_releases < 1 and self.correlated is None:
            raise ValueError("target_epsilon needs planned_releases >= 1")
        if not self.max_epsilon > 0:
            raise ValueError(f"max_epsilon must be > 0 (inf: no budget), got {self.max_epsilon}")
        if not (self.public_denominator >= 0 and math.isfinite(self.public_denominator)):
            raise ValueError(f"public_denominator must be finite and >= 0, got {self.public_denominator}")
        if (self.release_mean or self.adaptive is not None) and self.public_denominator <= 0:
            raise ValueError("a mean and adaptive clipping divide by a public_denominator > 0"
                             " (the expected number of contributions)")
        if self.adaptive is not None and self.adaptive.count_stddev == 0 and self.noise_multiplier != 0:
            raise ValueError("adaptive clipping under noise needs adaptive.count_stddev > 0: the next bound comes"
                             " from the count of unclipped contributions, which must be noised too")
        if not (self.metrics_noise_multiplier >= 0 and math.isfinite(self.metrics_noise_multiplier)):
            raise ValueError(f"metrics_noise_multiplier must be finite and >= 0, got {self.metrics_noise_multiplier}")
        check_supported(self.accountant, self.neighbouring, self.sampling)
        self._check_noise()
        self._check_correlated()
        self._check_participation()
        if self.audit is not None and (self.debug_raw_statistics or self.noise_multiplier == 0):
            raise ValueError("an audit measures the noise of private releases: not with debug_raw_statistics"
                             " (its raw statistics make epsilon infinite) nor with noise_multiplier 0")

    def _check_correlated(self) -> None:
        if self.correlated is None:
            return
        refused = [what for what, given in (
            ("secure noise", self.noise is Noise.SECURE),
            ("adaptive clipping (the bound would change the stream's sensitivity from release to release)",
             self.adaptive is not None),
            ("released statistics (metrics_noise_multiplier)", self.metrics_noise_multiplier > 0),
            ("debug_raw_statistics (its ledger entries would break the stream's accounting)",
             self.debug_raw_statistics),
            ("sampling amplification (the participation is (b, k): min_separation, max_participations)",
             self.sampling.kind is not SamplingKind.NONE)) if given]
        if refused:
            raise ValueError(f"correlated noise ({self.correlated.mechanism.value}) does not take"
                             f" {'; '.join(refused)}")

    def _check_participation(self) -> None:
        if self.participation is None:
            return
        refused = [what for what, given in (
            ("correlated noise (its stream has min_separation and max_participations of its own)",
             self.correlated is not None),
            ("sampling amplification (a unit's privacy comes from how often it takes part)",
             self.sampling.kind is not SamplingKind.NONE),
            ("debug_raw_statistics (its ledger entries would break the accounting)", self.debug_raw_statistics),
            ("target_epsilon (give noise_multiplier)", self.target_epsilon is not None)) if given]
        if refused:
            raise ValueError(f"participation limits do not take {'; '.join(refused)}")

    def _check_noise(self) -> None:
        secure_noise = self.noise is Noise.SECURE
        if secure_noise != (self.accountant is Accountant.ZCDP):
            raise ValueError("secure noise is accounted by the zcdp accountant (OpenDP), and the zcdp accountant"
                             f" accounts secure noise only: got noise {self.noise.value!r} with accountant"
                             f" {self.accountant.value!r}")
        if secure_noise:
            refused = [what for what, given in (
                ("adaptive clipping", self.adaptive is not None),
                ("released statistics (metrics_noise_multiplier)", self.metrics_noise_multiplier > 0),
                ("a seed (the secure sampler draws from a CSPRNG only)", self.seed is not None)) if given]
            if refused:
                raise ValueError(f"secure noise does not take {', '.join(refused)} (not built yet: their noise"
                                 " would be float Gaussians)")

    @property
    def total_noise_multiplier(self) -> float:
        """``z``: the given one, or the one calibrated to ``target_epsilon`` over the planned releases."""
        if self.noise_multiplier is not None:
            return self.noise_multiplier
        assert self.target_epsilon is not None  # __post_init__: exactly one of the two is set
        if self.correlated is not None:  # the whole stream is one Gaussian mechanism
            return calibrate_noise_multiplier(self.target_epsilon, self.delta, 1, Sampling(), self.accountant,
                                              self.neighbouring)
        return calibrate_noise_multiplier(self.target_epsilon, self.delta, self.planned_releases, self.sampling,
                                          self.accountant, self.neighbouring)

    def plan(self, example_bound: float, layers: Sequence) -> ReleasePlan:
        """The noise of one release of ``layers`` (``LayerSpec``s) whose contributions are clipped to
        ``example_bound``."""
        from dp_accounting import dp_event as dpe

        z = self.total_noise_multiplier
        s = sensitivity(example_bound, self.neighbouring)
        if self.correlated is not None:  # sigma = z * clip * sens(C): the whole stream is one event of z
            event = dpe.GaussianDpEvent(z) if z > 0 else dpe.NonPrivateDpEvent()
            return ReleasePlan(noise_multiplier=z, value_noise_multiplier=z, sensitivity=s,
                               noise_stddev=z * s * self.correlated.sensitivity(), count_noise_stddev=0.0,
                               metrics_noise_stddev=0.0, event=event, event_json=event_to_json(event))
        if self.noise is Noise.SECURE:
            dimension = sum(layer.size for layer in layers)
            contributions = int(sensitivity(1.0, self.neighbouring))  # examples one neighbour changes: 1 or 2
            step, widened, scale = secure.plan(example_bound, contributions, z, dimension)
            event_json = secure.release_event_json(widened, scale, step, dimension)
            if z == 0:  # no noise: nothing private, as with the float noise (the sums are still on the grid)
                event_json = event_to_json(dpe.NonPrivateDpEvent())
            return ReleasePlan(noise_multiplier=z, value_noise_multiplier=z, sensitivity=s, noise_stddev=scale * step,
                               count_noise_stddev=0.0, metrics_noise_stddev=0.0, event=None, event_json=event_json,
                               grid_step=step, grid_scale=scale)
        count_z = 0.0
        if self.adaptive is not None and self.adaptive.count_stddev > 0:
            count_z = self.adaptive.count_stddev / count_sensitivity(self.neighbouring)
        companions = [c for c in (count_z, self.metrics_noise_multiplier) if c > 0]
        value_z = value_noise_multiplier(z, companions)
        stats_s = statistics_sensitivity(len(layers), self.neighbouring)
        event = release_event(value_z, companions, self.sampling)
        return ReleasePlan(
            noise_multiplier=z, value_noise_multiplier=value_z, sensitivity=s, noise_stddev=value_z * s,
            count_noise_stddev=self.adaptive.count_stddev if self.adaptive is not None else 0.0,
            metrics_noise_stddev=self.metrics_noise_multiplier * stats_s, event=event,
            event_json=event_to_json(event))


@dataclasses.dataclass(frozen=True)
class ReleasePlan:
    noise_multiplier: float  # z, total
    value_noise_multiplier: float  # z_v, of the sum alone
    sensitivity: float  # of the sum
    noise_stddev: float  # per coordinate of the sum: z_v * sensitivity
    count_noise_stddev: float  # sigma_b, on the centred unclipped count (adaptive)
    metrics_noise_stddev: float  # per coordinate of the statistics vector
    event: dpe.DpEvent | None  # dp_accounting's event (None for secure noise: see event_json)
    event_json: str  # the event as the ledger stores it (secure noise: _secure_noise.release_event_json)
    grid_step: float = 0.0  # secure noise: g, the step of the fixed-point sums and of the release
    grid_scale: float = 0.0  # secure noise: the discrete Gaussian's scale, in grid steps
