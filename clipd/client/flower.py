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
* With ``Privacy(..., sampling="poisson", sampling_rate=q, drawn_by="server")`` clipd, not the wrapped
  strategy, decides who trains: the wrapped strategy offers the nodes (let it offer all of them:
  ``fraction_train=1.0``), and only those clipd draws for the round's release are sent training
  (``num_sampled_clients``: the expected count, q times the nodes). A reply from a node it did not
  draw would be refused, so it is not sent.
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

import logging
from collections.abc import Iterable

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import Strategy
except ImportError as e:  # pragma: no cover - exercised where flwr is missing
    raise ImportError("clipd.client.flower needs Flower's Message API: pip install '.[flower]' (flwr 1.41)") from e

from ._client import Client
from .errors import ClipdError
from .privacy import Privacy
from .rounds import PrivateRounds

log = logging.getLogger("flwr").getChild("clipd")  # shown by Flower's console handler

__all__ = ["ClipdStrategy"]


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
        self.rounds = PrivateRounds(client, clipping_norm=clipping_norm, num_sampled_clients=num_sampled_clients,
                                    privacy=privacy, non_finite=non_finite, keep_results=keep_results, log=log,
                                    name="flower")
        self.strategy = strategy
        self.client = client
        self.num_sampled_clients = num_sampled_clients
        self.privacy = self.rounds.privacy  # (its public denominator set)
        self.arrayrecord_key = arrayrecord_key or getattr(strategy, "arrayrecord_key", "arrays")

    stopped = property(lambda self: self.rounds.stopped, doc="why training stopped (a refused release), or None")
    releases = property(lambda self: self.rounds.releases, doc="the clipd Release of each released round")
    clipping_norm = property(lambda self: self.rounds.clipping_norm,
                             doc="the bound of the next round (adaptive clipping moves it)")

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
        if len(messages) != self.num_sampled_clients and not self.rounds.server_draws:
            log.warning("configure_train: %d clients sampled, but the public denominator m is %s: the mean"
                        " divides by m", len(messages), self.num_sampled_clients)
        if not self.rounds.open(server_round, {name: array.numpy() for name, array in arrays.items()}):
            return []
        if self.rounds.server_draws:  # clipd draws the round's nodes among those offered: only they train
            drawn = set(self.rounds.drawn(f"n{m.metadata.dst_node_id}" for m in messages))
            log.info("configure_train: clipd drew %d of the %d nodes offered for round %s", len(drawn),
                     len(messages), server_round)
            messages = [m for m in messages if f"n{m.metadata.dst_node_id}" in drawn]
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Streams each reply's update to clipd, finalizes, and returns ``current + noised_sum / m``."""
        round_ = self.rounds.open_round
        if round_ is None or round_.number != server_round:
            if self.stopped is None:
                log.warning("aggregate_train: no clipd aggregation is open for round %s", server_round)
            return None, None
        try:
            for reply in replies:
                self._submit(reply)
        except ClipdError as e:  # the server stayed unreachable
            log.error("aggregate_train: round %s not aggregated (model unchanged): %s", server_round, e)
            self.rounds.cancel_open()
            return None, None
        arrays, metrics = self.rounds.release()
        if arrays is None:
            return None, None
        return ArrayRecord({name: Array(a) for name, a in arrays.items()}), MetricRecord(metrics)

    def _submit(self, reply: Message) -> None:
        """Sends one reply's update as its node's one contribution (or nothing, logged)."""
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.info("aggregate_train: reply from node %s carries an error (%s): nothing sent", node,
                     reply.error.reason)
            return
        records = reply.content.array_records
        record = records.get(self.arrayrecord_key) or (next(iter(records.values())) if len(records) == 1 else None)
        if record is None:
            log.warning("aggregate_train: reply from node %s does not hold the model's arrays: nothing sent", node)
            return
        update = self.rounds.update_from(f"node {node}", {k: record[k].numpy() for k in record.keys()}, diff=False)
        if update is not None:
            self.rounds.submit(f"n{node}", update)

    # Evaluation: the wrapped strategy's --------------------------------------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)
