"""Private federated rounds through clipd: what a framework's server-side aggregator does, framework aside.

Each round of a federated job is one clipd aggregation with ``unit="client"`` (each site or node one
contribution, submitted by the aggregator as a trusted submitter under the site's name), opened before its
clients train where the framework allows it, so that a ledger that can't afford the release refuses it before
any work is done. Each reply's update (``reply - current`` for every floating array) is streamed into it as it
arrives; the release is ``current + noised_sum / m``, with ``m`` the public number of sampled sites (never the
replies that arrived, never a weighted mean: either would make the noise calibration ``z * C / m`` wrong).

:class:`PrivateRounds` holds that logic once; :mod:`clipd.client.flower` (Flower's ``Strategy``) and
:mod:`clipd.client.nvflare` (NVFlare's ``ModelAggregator``) adapt it to their framework's messages.

>>> rounds = PrivateRounds(client, clipping_norm=1.0, num_sampled_clients=3, privacy=None)  # doctest: +SKIP
>>> rounds.open(1, {"w": np.zeros(4, np.float32)})  # doctest: +SKIP
True
>>> rounds.submit("site-1", {"w": np.ones(4)})  # doctest: +SKIP
True
>>> arrays, metrics = rounds.release()  # doctest: +SKIP
>>> arrays["w"]  # doctest: +SKIP
array([0.16666667, 0.16666667, 0.16666667, 0.16666667], dtype=float32)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._client import AggregateResult, Client
from .errors import ClipdError, FailedPreconditionError
from .privacy import Privacy

__all__ = ["PrivateRounds", "Round"]


@dataclasses.dataclass
class Round:
    """The round open now: its number, its clipd aggregation, the global arrays its sites started from."""

    number: int
    aggregation_id: str
    current: dict[str, np.ndarray]  # the global arrays sent to the sites, all of them, in order
    submitted: int = 0  # updates summed so far
    draws: dict[str, bool] = dataclasses.field(default_factory=dict)  # the server's draws asked so far (its sampling)


def update_of(params: Mapping[str, Any], current: Mapping[str, np.ndarray], *,
              diff: bool) -> tuple[dict[str, np.ndarray] | None, str]:
    """A reply's update of a model whose global arrays are ``current``: its floating arrays, as they are when they
    are a difference (``diff``), else ``params - current`` (float64); or ``(None, why)`` when it does not hold them
    in their shapes (``why`` continues "the reply of <site>").

    >>> update_of({"w": np.array([3.0, 5.0])}, {"w": np.array([1.0, 1.0])}, diff=False)
    ({'w': array([2., 4.])}, '')
    >>> update_of({"w": np.zeros(3)}, {"w": np.zeros(2)}, diff=True)[1]
    ": array 'w' has shape (3,), the model (2,)"
    """
    floating = [name for name, a in current.items() if np.issubdtype(np.asarray(a).dtype, np.floating)]
    missing = [name for name in floating if name not in params]
    if missing or (not diff and set(params) != set(current)):
        return None, (f" does not hold the model's arrays (missing {missing or sorted(set(current) - set(params))},"
                      " or others)")
    update = {}
    for name in floating:
        new, old = np.asarray(params[name]), np.asarray(current[name])
        if new.shape != old.shape:
            return None, f": array {name!r} has shape {new.shape}, the model {old.shape}"
        update[name] = new if diff else np.subtract(new, old, dtype=np.float64)
    return update, ""


BLOCK = 1 << 20  # elements of an array computed at a time in float64 (8 MiB of temporaries, whatever the model)


def _new_array(current: np.ndarray, sums: np.ndarray, m: float, as_update: bool) -> np.ndarray:
    """``sums / m`` (``as_update``) or ``current + sums / m``, computed in float64 and rounded once to
    ``current``'s dtype, a block at a time: a whole float64 copy of a large model's layer would cost the
    framework's server twice the layer's memory at every release.

    >>> _new_array(np.ones(3, np.float32), np.array([3.0, 6.0, 9.0]), 3.0, as_update=False)
    array([2., 3., 4.], dtype=float32)
    >>> _new_array(np.ones(3, np.float32), np.array([3.0, 6.0, 9.0]), 3.0, as_update=True)
    array([1., 2., 3.], dtype=float32)
    """
    current, sums = np.asarray(current), np.asarray(sums)
    out = np.empty(current.shape, current.dtype)
    flat_out, flat_sums = out.reshape(-1), sums.reshape(-1)
    flat_current = None if as_update else np.ascontiguousarray(current).reshape(-1)
    for start in range(0, flat_out.size, BLOCK):
        block = flat_sums[start:start + BLOCK].astype(np.float64)
        if m != 1.0:
            block /= m
        if flat_current is not None:
            block += flat_current[start:start + BLOCK]
        flat_out[start:start + BLOCK] = block
    return out


class PrivateRounds:
    """One clipd aggregation and release per round of a federated job.

    Args:
      client: a connected :class:`clipd.client.Client`, holding the admin token (it creates and finalizes each
        round's aggregation, and submits each site's update under the site's name); not closed here.
      clipping_norm: the bound C on each site's update (one L2 norm over all floating arrays). With adaptive
        clipping: None (the bound starts at ``privacy.adaptive.initial_bound`` and the server moves it).
      num_sampled_clients: m, the public denominator: the sites sampled per round.
      privacy: the privacy policy of every round's release, all on its ``ledger_id``; ``public_denominator`` is set
        to ``num_sampled_clients`` if left at 0 (another value is refused). None: no noise, no DP.
      non_finite: clipd's policy for an update holding NaN or inf (``zero_example``: zeroed and counted).
      keep_results: leave each finalized aggregation on the server (cancelled after reading by default: the
        ledger keeps the release).
      log: where it says what it does (a ``logging.Logger``, or anything with ``info``, ``warning`` and ``error``).
      name: the prefix of its aggregations' ids.
    """

    def __init__(self, client: Client, *, clipping_norm: float | None, num_sampled_clients: float,
                 privacy: Privacy | None, non_finite: str = "zero_example", keep_results: bool = False,
                 log: Any = None, name: str = "rounds") -> None:
        self.log = log if log is not None else logging.getLogger("clipd.rounds")
        if not (num_sampled_clients > 0 and math.isfinite(num_sampled_clients)):
            raise ValueError(f"num_sampled_clients must be > 0, got {num_sampled_clients}")
        adaptive = privacy.adaptive if privacy is not None else None
        if adaptive is not None:
            if clipping_norm is not None and clipping_norm != adaptive.initial_bound:
                raise ValueError("with adaptive clipping the bound starts at privacy.adaptive.initial_bound and the"
                                 " server moves it: leave clipping_norm None")
            clipping_norm = adaptive.initial_bound
        if clipping_norm is None or not clipping_norm > 0:
            raise ValueError(f"clipping_norm must be > 0, got {clipping_norm}")
        if privacy is not None:
            if privacy.public_denominator == 0:
                privacy = dataclasses.replace(privacy, public_denominator=float(num_sampled_clients))
            elif privacy.public_denominator != num_sampled_clients:
                raise ValueError(f"privacy.public_denominator ({privacy.public_denominator}) must be"
                                 f" num_sampled_clients ({num_sampled_clients}): the mean divides by it")
        else:
            self.log.warning("clipd without a privacy policy: updates are clipped but not noised"
                             " (not differentially private)")
        self.client = client
        self.clipping_norm = float(clipping_norm)
        self.num_sampled_clients = num_sampled_clients
        self.privacy = privacy
        self.non_finite = non_finite
        self.keep_results = keep_results
        self.name = name
        self.stopped: str | None = None  # why training stopped (a refused release), or None
        self.releases: list = []  # one clipd Release per released round
        self.open_round: Round | None = None

    # A round --------------------------------------------------------------------------------------------
    def open(self, number: int, current: Mapping[str, np.ndarray]) -> bool:
        """Opens round ``number``'s aggregation for a model whose global arrays are ``current``: True if it is
        open; False if training has stopped, or stops now (the ledger refuses the round's release)."""
        if self.stopped is not None:
            return False
        self.cancel_open()
        current = {name: np.asarray(a) for name, a in current.items()}
        floating = [name for name, a in current.items() if np.issubdtype(a.dtype, np.floating)]
        if not floating:
            raise ValueError("the model has no floating arrays to aggregate")
        try:
            aggregation_id = self.client.create_aggregation(
                {name: tuple(current[name].shape) for name in floating}, policy="global",
                l2_norm_clip=self.clipping_norm, non_finite=self.non_finite, privacy=self.privacy,
                aggregation_id=f"{self.name}-r{number}-{uuid.uuid4().hex[:16]}", unit="client",
            )
        except FailedPreconditionError as e:  # the ledger's budget (or its configuration) refuses the release
            self.stop(f"clipd refused round {number}'s release: {e.details}")
            return False
        self.open_round = Round(number, aggregation_id, current)
        return True

    @property
    def server_draws(self) -> bool:
        """Whether the server draws each round's sites (``Privacy(..., drawn_by="server")``)."""
        return self.privacy is not None and self.privacy.drawn_by == "server"

    def drawn(self, sites: Iterable[str]) -> list[str]:
        """The ``sites`` that take part in the open round: those the server draws for its release when it draws
        them (asked once a round each; the others' updates would be refused), else all of them."""
        sites = list(sites)
        round_ = self.open_round
        if round_ is None or not self.server_draws:
            return sites
        new = [site for site in dict.fromkeys(sites) if site not in round_.draws]
        if new:
            chosen = set(self.client.draw_clients(round_.aggregation_id, new))
            round_.draws.update({site: site in chosen for site in new})
        return [site for site in sites if round_.draws[site]]

    def update_from(self, site: str, params: Mapping[str, Any], *, diff: bool) -> dict[str, np.ndarray] | None:
        """A site's update from its reply (:func:`update_of`); None (logged) when it does not hold the model's floating
        arrays in their shapes."""
        round_ = self.open_round
        if round_ is None:
            return None
        update, why = update_of(params, round_.current, diff=diff)
        if update is None:
            self.log.warning(f"round {round_.number}: the reply of {site}{why}: it contributes nothing")
        return update

    def submit(self, site: str, update: Mapping[str, np.ndarray]) -> bool:
        """Streams one site's update as its one contribution: True if summed; False (logged) if refused. A server
        that stays unreachable raises (the round can't be released as it should)."""
        round_ = self.open_round
        if round_ is None:
            return False
        if self.server_draws and not self.drawn([site]):
            self.log.info(f"round {round_.number}: {site} was not drawn for this round's release: its update is not"
                          " sent (the server draws each round's sites)")
            return False
        try:
            self.client.submit(round_.aggregation_id, dict(update), client_id=site)
        except ClipdError as e:
            if e.retryable:
                raise
            self.log.warning(f"round {round_.number}: the update of {site} was refused ({e}): it contributes"
                             " nothing")
            return False
        round_.submitted += 1
        return True

    def release(self, as_update: bool = False) -> tuple[dict[str, np.ndarray] | None, dict[str, Any]]:
        """Finalizes the open round: ``(current + noised_sum / m, privatised metrics)``, or with ``as_update`` the
        noised mean alone (``noised_sum / m`` of each floating array, in its dtype); ``(None, {})`` when it is not
        released (no round open, the ledger refuses it: training stops, or the server fails: logged)."""
        round_, self.open_round = self.open_round, None
        if round_ is None:
            return None, {}
        self.log.info(f"round {round_.number}: {round_.submitted} updates streamed to clipd; releasing the sum"
                      f" over m = {self.num_sampled_clients}")
        try:
            result = self.client.finalize(round_.aggregation_id)
        except FailedPreconditionError as e:  # refused at finalize (the budget, checked again)
            self._cancel(round_.aggregation_id)
            self.stop(f"clipd refused round {round_.number}'s release: {e.details}")
            return None, {}
        except ClipdError as e:
            self.log.error(f"round {round_.number} not aggregated (model unchanged): {e}")
            self._cancel(round_.aggregation_id)
            return None, {}
        if not self.keep_results:
            self._cancel(round_.aggregation_id)
        return self._new_arrays(round_, result, as_update), self.metrics(result)

    def _new_arrays(self, round_: Round, result: AggregateResult, as_update: bool) -> dict[str, np.ndarray]:
        release = result.release
        divide = not (release is not None and release.mean)  # the server already divided by m
        arrays = {}
        for name, current in round_.current.items():
            if name in result.sums:
                current = _new_array(current, result.sums[name], self.num_sampled_clients if divide else 1.0,
                                     as_update)
            elif as_update:
                continue
            arrays[name] = np.asarray(current)
        if release is not None:
            self.releases.append(release)
            if release.next_bound > 0:
                self.clipping_norm = release.next_bound
        return arrays

    def metrics(self, result: AggregateResult) -> dict[str, Any]:
        """A round's metrics: privatised values only (the release's), or the bound alone without privacy."""
        release = result.release
        if release is None:  # no privacy policy: nothing here is private, so publish nothing about the clients
            return {"bound": float(self.clipping_norm)}
        metrics: dict = {
            "epsilon": release.epsilon, "ledger-epsilon": release.ledger_epsilon, "delta": release.delta,
            "noise-stddev": release.noise_stddev,
            "noise-stddev-of-mean": release.noise_stddev / self.num_sampled_clients,
            "bound": release.bound, "next-bound": release.next_bound,
        }
        if math.isfinite(release.budget_left):
            metrics["budget-left"] = release.budget_left
        if release.mechanism:  # a correlated stream: which of its releases this round is
            metrics["stream-release"] = release.stream_release
        if self.privacy is not None and self.privacy.adaptive is not None:
            metrics["unclipped-fraction"] = release.unclipped_fraction
        if release.statistics_noise_stddev > 0 or release.debug_raw_statistics:
            metrics["examples"] = release.examples
            metrics["statistics-noise-stddev"] = release.statistics_noise_stddev
            if release.layer_clipped:
                metrics["layer-clipped"] = [float(v) for v in release.layer_clipped]
            if release.example_norm_histogram:
                metrics["norm-histogram"] = [float(v) for v in release.example_norm_histogram]
        if release.seeded:
            metrics["seeded-noise"] = 1  # test mode: the noise is reproducible, not private
        if release.debug_raw_statistics:
            metrics["debug-raw-statistics"] = 1  # the ledger's epsilon is infinite
        return {k: float(v) if isinstance(v, (int, float)) else v for k, v in metrics.items()}

    # Plumbing -------------------------------------------------------------------------------------------
    def stop(self, reason: str) -> None:
        self.stopped = reason
        self.log.warning(f"clipd: training stops: {reason}")

    def cancel_open(self) -> None:
        """Cancels an aggregation whose round never reached its release (that release stays unmade)."""
        if self.open_round is not None:
            self._cancel(self.open_round.aggregation_id)
            self.open_round = None

    def _cancel(self, aggregation_id: str) -> None:
        try:
            self.client.cancel(aggregation_id)
        except ClipdError as e:
            self.log.warning(f"could not cancel clipd aggregation {aggregation_id}: {e}")
