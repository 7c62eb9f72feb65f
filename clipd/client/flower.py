"""A Flower strategy that aggregates through clipd: per-client updates clipped, and released with DP.

Flower's ``DifferentialPrivacyServerSideFixedClipping`` clips each reply's update
in the ServerApp, averages with FedAvg and adds ``z * C / m`` noise with numpy's
global generator. :class:`ClipdStrategy` sends the updates to a clipd server
instead, which clips, sums, noises and accounts the release::

    from flwr.serverapp.strategy import FedAvg
    from clipd.client import Client, Privacy
    from clipd.client.flower import ClipdStrategy

    client = Client("clipd.example.org:50051", token=ADMIN_TOKEN)
    strategy = ClipdStrategy(
        FedAvg(fraction_train=0.1, min_train_nodes=10, fraction_evaluate=0.0),
        client, clipping_norm=1.0, num_sampled_clients=10,
        privacy=Privacy(ledger_id="run-42", delta=1e-5, noise_multiplier=1.0, max_epsilon=8.0),
    )
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model), num_rounds=100)

Each round:

* ``configure_train`` opens a clipd aggregation for the round (GLOBAL clip
  policy: one L2 norm over all the model's floating arrays) BEFORE any client
  is asked to train, so a ledger that can't afford the release refuses it
  (``FailedPreconditionError``) and no client work is wasted: the strategy logs
  why, sends no more training (``strategy.stopped`` holds the reason) and the
  remaining rounds of ``start`` do nothing but evaluate the last model.
* The round's aggregation has ``unit="client"``: each node is one unit of
  privacy. The strategy submits as a trusted submitter (its client holds the
  admin token, or a submitter token) under each reply's node id (``n<node id>``,
  Flower's authenticated SuperNode id), so the server counts nodes, not names a
  client could pick: a node contributes once a round (a second reply of one node
  is refused and contributes nothing), and under a correlated noise stream the
  server enforces each node's participation across rounds.
* ``aggregate_train`` streams each reply's update, ``reply - current`` for every
  floating array, as its node's one contribution; finalizes;
  and returns ``current + noised_sum / m``. ``m`` is the public denominator
  ``num_sampled_clients`` (set as the privacy policy's ``public_denominator``),
  never the number of replies that arrived and never FedAvg's weighted
  average: either would make the noise calibration ``z * C / m`` wrong (a
  client that drops out then shifts the mean, which is what DP must hide).
* A reply with an error, without the model's arrays or with other shapes
  contributes nothing (logged). An update that is exactly zero is fine (norm 0
  is not divided by), and one holding NaN or inf is zeroed by the server
  (``non_finite="zero_example"``): it is counted in the denominator like a
  client whose update is zero. Flower's wrapper raises ZeroDivisionError on the
  first and lets the second through unclipped.
* Arrays that are not floating (e.g. BatchNorm's ``num_batches_tracked``) are
  kept at their global value: they are neither sent nor averaged.
* The round's metrics are privatised values only: the release's ``epsilon``,
  ``ledger-epsilon``, ``delta``, ``noise-stddev`` (per coordinate of the sum)
  and ``noise-stddev-of-mean``, ``bound``, ``next-bound``, ``budget-left``
  (with a budget), the noised ``unclipped-fraction`` (adaptive clipping) and,
  when the policy sets ``metrics_noise_multiplier``, the noised ``examples``
  count, ``layer-clipped`` and ``norm-histogram``. The clients' own train
  metrics are not aggregated (they are not privatised).

With adaptive clipping (``Privacy(adaptive=Adaptive(...))``) the server keeps
the bound on the ledger: each round's aggregation clips at the previous
release's ``next_bound`` (Andrew et al.'s rule on the noised unclipped
fraction), so the strategy needs no state for it; ``strategy.clipping_norm``
follows it for display. Without a privacy policy the aggregate is clipped but
not noised: not differentially private (a warning says so).

Needs Flower's Message API (``pip install '.[flower]'``: flwr 1.41); the
clipd client itself needs only numpy, grpcio and protobuf.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from collections.abc import Iterable

import numpy as np

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import Strategy
except ImportError as e:  # pragma: no cover - exercised where flwr is missing
    raise ImportError("clipd.client.flower needs Flower's Message API: pip install '.[flower]' (flwr 1.41)") from e

from clipd.v1 import clipd_pb2 as pb

from ._client import AggregateResult, Client
from .errors import ClipdError, FailedPreconditionError
from .privacy import Privacy

log = logging.getLogger("flwr").getChild("clipd")  # shown by Flower's console handler

__all__ = ["ClipdStrategy"]


@dataclasses.dataclass
class _Round:
    server_round: int
    aggregation_id: str
    current: dict[str, np.ndarray]  # the global arrays sent to the clients, all of them, in order
    floating: list[str]  # the ones clipd aggregates


class ClipdStrategy(Strategy):
    """Wraps a Flower strategy (for sampling, configuration and evaluation) and aggregates training through clipd.

    Args:
      strategy: the strategy whose ``configure_train``, ``configure_evaluate``,
        ``aggregate_evaluate`` and ``summary`` are used (e.g. ``FedAvg``). Its
        ``aggregate_train`` is not.
      client: a connected :class:`clipd.client.Client` (with the admin token if
        the server has one); the strategy does not close it.
      clipping_norm: the bound C on each client's update (one L2 norm over all
        floating arrays). With adaptive clipping: leave it None (the bound
        starts at ``privacy.adaptive.initial_bound`` and the server moves it).
      num_sampled_clients: m, the public denominator: the number of clients
        sampled per round (or the expected number under Poisson sampling).
      privacy: the privacy policy of every round's release, all on its
        ``ledger_id``. ``public_denominator`` is set to ``num_sampled_clients``
        if left at 0 (another value is refused). None: no noise, no DP.
      non_finite: clipd's policy for an update holding NaN or inf
        (``zero_example``: zeroed and counted; see ``Client.create_aggregation``).
      arrayrecord_key: the reply's ArrayRecord to read when it has several
        (default: the wrapped strategy's ``arrayrecord_key``, else ``"arrays"``).
      keep_results: leave each finalized aggregation on the server (it is
        cancelled after reading by default: the ledger keeps the release).
    """

    def __init__(
        self,
        strategy: Strategy,
        client: Client,
        *,
        clipping_norm: float | None = None,
        num_sampled_clients: float,
        privacy: Privacy | None = None,
        non_finite: str = "zero_example",
        arrayrecord_key: str | None = None,
        keep_results: bool = False,
    ) -> None:
        super().__init__()
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
            log.warning("ClipdStrategy without a privacy policy: updates are clipped but not noised"
                        " (not differentially private)")
        self.strategy = strategy
        self.client = client
        self.clipping_norm = float(clipping_norm)
        self.num_sampled_clients = num_sampled_clients
        self.privacy = privacy
        self.non_finite = non_finite
        self.arrayrecord_key = arrayrecord_key or getattr(strategy, "arrayrecord_key", "arrays")
        self.keep_results = keep_results
        self.stopped: str | None = None  # why training stopped (a refused release), or None
        self.releases: list[pb.Release] = []  # one per released round
        self._open: _Round | None = None

    def __repr__(self) -> str:
        return f"ClipdStrategy({self.strategy!r}, C={self.clipping_norm}, m={self.num_sampled_clients})"

    def summary(self) -> None:
        log.info("\t├──> clipd: clipped and summed by the server, released as current + noised_sum / m")
        log.info("\t│\t├── Clipping norm: %s%s", self.clipping_norm,
                 " (adaptive)" if self.privacy is not None and self.privacy.adaptive is not None else "")
        log.info("\t│\t├── Public denominator m: %s", self.num_sampled_clients)
        if self.privacy is None:
            log.info("\t│\t└── Privacy: none (not differentially private)")
        else:
            log.info("\t│\t└── Privacy: ledger %r, z = %s, delta = %g, max epsilon %s", self.privacy.ledger_id,
                     self.privacy.noise_multiplier, self.privacy.delta, self.privacy.max_epsilon or "none")
        self.strategy.summary()

    # Training --------------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's training messages, once clipd has accepted the round's aggregation."""
        if self.stopped is not None:
            log.info("configure_train: no training in round %s: %s", server_round, self.stopped)
            return []
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if not messages:
            return []
        if len(messages) != self.num_sampled_clients:
            log.warning("configure_train: %d clients sampled, but the public denominator m is %s: the mean"
                        " divides by m", len(messages), self.num_sampled_clients)
        self._cancel_open()
        current = {name: array.numpy() for name, array in arrays.items()}
        floating = [name for name, a in current.items() if np.issubdtype(a.dtype, np.floating)]
        if not floating:
            raise ValueError("ClipdStrategy: the model has no floating arrays to aggregate")
        try:
            aggregation_id = self.client.create_aggregation(
                {name: tuple(current[name].shape) for name in floating}, policy="global",
                l2_norm_clip=self.clipping_norm, non_finite=self.non_finite, privacy=self.privacy,
                aggregation_id=f"flower-r{server_round}-{uuid.uuid4().hex[:16]}", unit="client",
            )
        except FailedPreconditionError as e:  # the ledger's budget (or its configuration) refuses the release
            self._stop(f"clipd refused round {server_round}'s release: {e.details}")
            return []
        self._open = _Round(server_round, aggregation_id, current, floating)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Streams each reply's update to clipd, finalizes, and returns ``current + noised_sum / m``."""
        replies = list(replies)
        round_ = self._open
        if round_ is None or round_.server_round != server_round:
            if self.stopped is None:
                log.warning("aggregate_train: no clipd aggregation is open for round %s", server_round)
            return None, None
        self._open = None
        sent = 0
        try:
            for reply in replies:
                sent += self._submit(round_, reply)
            log.info("aggregate_train: %d of %d replies streamed to clipd; releasing the sum over m = %s",
                     sent, len(replies), self.num_sampled_clients)
            result = self.client.finalize(round_.aggregation_id)
        except FailedPreconditionError as e:  # refused at finalize (the budget, checked again)
            self._cancel(round_.aggregation_id)
            self._stop(f"clipd refused round {server_round}'s release: {e.details}")
            return None, None
        except ClipdError as e:
            log.error("aggregate_train: round %s not aggregated (model unchanged): %s", server_round, e)
            self._cancel(round_.aggregation_id)
            return None, None
        if not self.keep_results:
            self._cancel(round_.aggregation_id)
        return self._new_arrays(round_, result), self._metrics(result)

    def _submit(self, round_: _Round, reply: Message) -> int:
        """Sends one reply's update as one contribution; 1 if it was summed, 0 if it was skipped."""
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.info("aggregate_train: reply from node %s carries an error (%s): nothing sent", node,
                     reply.error.reason)
            return 0
        records = reply.content.array_records
        record = records.get(self.arrayrecord_key) or (next(iter(records.values())) if len(records) == 1 else None)
        if record is None or set(record.keys()) != set(round_.current):
            log.warning("aggregate_train: reply from node %s does not hold the model's arrays: nothing sent", node)
            return 0
        update = {}
        for name in round_.floating:
            new, old = record[name].numpy(), round_.current[name]
            if new.shape != old.shape:
                log.warning("aggregate_train: reply from node %s: array %r has shape %s, the model %s: nothing"
                            " sent", node, name, new.shape, old.shape)
                return 0
            update[name] = np.subtract(new, old, dtype=np.float64)
        try:
            self.client.submit(round_.aggregation_id, update, client_id=f"n{node}")
        except ClipdError as e:
            if e.retryable:  # the server stayed unreachable: the round can't be released as it should
                raise
            log.warning("aggregate_train: update of node %s refused (%s): it contributes nothing", node, e)
            return 0
        return 1

    def _new_arrays(self, round_: _Round, result: AggregateResult) -> ArrayRecord:
        release = result.release
        divide = not (release is not None and release.mean)  # the server already divided by m
        arrays = {}
        for name, current in round_.current.items():
            if name in result.sums:
                mean = result.sums[name].astype(np.float64)
                if divide:
                    mean = mean / self.num_sampled_clients
                current = (current + mean).astype(current.dtype)
            arrays[name] = Array(np.asarray(current))
        if release is not None:
            self.releases.append(release)
            if release.next_bound > 0:
                self.clipping_norm = release.next_bound
        return ArrayRecord(arrays)

    def _metrics(self, result: AggregateResult) -> MetricRecord:
        release = result.release
        if release is None:  # no privacy policy: nothing here is private, so publish nothing about the clients
            return MetricRecord({"bound": float(self.clipping_norm)})
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
        return MetricRecord({k: float(v) if isinstance(v, (int, float)) else v for k, v in metrics.items()})

    # Evaluation: the wrapped strategy's --------------------------------------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    # Plumbing ----------------------------------------------------------------------------------------
    def _stop(self, reason: str) -> None:
        self.stopped = reason
        log.warning("ClipdStrategy: training stops: %s", reason)

    def _cancel_open(self) -> None:
        """Cancels an aggregation whose round never reached aggregate_train (its release stays unmade)."""
        if self._open is not None:
            self._cancel(self._open.aggregation_id)
            self._open = None

    def _cancel(self, aggregation_id: str) -> None:
        try:
            self.client.cancel(aggregation_id)
        except ClipdError as e:
            log.warning("could not cancel clipd aggregation %s: %s", aggregation_id, e)
