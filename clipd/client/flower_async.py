"""FedBuff on Flower's Grid through a clipd buffered stream: training that never waits for the slowest node.

Flower's strategies run rounds (``Strategy.start``: send, wait for every reply, aggregate). Its ``Grid`` also
lets a ServerApp push messages and pull replies as they come; :class:`ClipdAsyncStrategy` uses that to keep
``concurrency`` nodes training at once::

    from clipd.client import Buffer, Client, Privacy
    from clipd.client.flower_async import ClipdAsyncStrategy

    strategy = ClipdAsyncStrategy(
        Client("clipd.example.org:50051", token=ADMIN_TOKEN), clipping_norm=1.0, concurrency=20,
        buffer=Buffer(size=10, max_staleness=8, max_wait=30.0),
        privacy=Privacy(ledger_id="async-7", delta=1e-5, noise_multiplier=1.0, max_participations=50,
                        min_separation=3, release_mean=True, max_epsilon=8.0),
    )
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model), num_versions=200)

- Each idle node is sent the newest model with its version (config ``clipd-version``); its reply is submitted,
  as it arrives, to the stream (as a trusted submitter, under the node's id ``n<node id>``) as ``reply -
  model it trained from``, with that version: the stream weights it by its staleness, refuses it past
  ``max_staleness``, and counts it once. The node is then sent the newest model again.
- Each release the stream makes (every ``buffer.size`` contributions) moves the model: ``model +
  server_learning_rate * mean`` (the release's noised mean over K, its public denominator), applied in
  version order as it comes (``WatchReleases``).
- A node past its participation limits is sent nothing until it may take part again (the stream says from
  which version), or ever again once its limit is reached. The ledger's budget stops the stream, and the
  strategy ends cleanly with the last model released (``strategy.stopped`` says why).

Needs Flower's Message API (``pip install '.[flower]'``: flwr 1.41).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy.result import Result
except ImportError as e:  # pragma: no cover - exercised where flwr is missing
    raise ImportError("clipd.client.flower_async needs Flower's Message API: pip install '.[flower]' (flwr 1.41)"
                      ) from e

from ._client import Client
from .errors import ClipdError, FailedPreconditionError
from .privacy import Privacy
from .streams import Buffer, StreamRelease

log = logging.getLogger("flwr").getChild("clipd")

__all__ = ["ClipdAsyncStrategy"]

VERSION_KEY = "clipd-version"  # the model version a node is sent (its reply trains from it)


class ClipdAsyncStrategy:
    """Buffered asynchronous federated learning (FedBuff) through a clipd stream, on Flower's Grid.

    Args:
      client: a connected :class:`clipd.client.Client` with the admin token (it makes the stream and submits
        each node's update under the node's id).
      clipping_norm: the bound C on each node's update (one L2 norm over its floating arrays).
      concurrency: nodes training at once.
      buffer: the stream's :class:`~clipd.client.Buffer` (K, staleness, max_wait).
      privacy: the stream's privacy policy, with participation limits (``max_participations``,
        ``min_separation``); ``release_mean`` is set (the mean over K: its public denominator).
      server_learning_rate: FedBuff's server step on each released mean.
      stream_id: the stream's id (default: one made from the ledger's).
      arrayrecord_key: the reply's ArrayRecord to read (default ``"arrays"``).
      poll_interval: seconds between pulls of the replies when none came.
    """

    def __init__(self, client: Client, *, clipping_norm: float, concurrency: int, buffer: Buffer, privacy: Privacy,
                 server_learning_rate: float = 1.0, stream_id: str | None = None, arrayrecord_key: str = "arrays",
                 poll_interval: float = 0.05) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency: at least 1 node, got {concurrency}")
        if not clipping_norm > 0:
            raise ValueError(f"clipping_norm must be > 0, got {clipping_norm}")
        if not privacy.max_participations:
            raise ValueError("privacy: a stream needs participation limits (max_participations, min_separation)")
        self.client = client
        self.clipping_norm = clipping_norm
        self.concurrency = concurrency
        self.buffer = buffer
        self.privacy = dataclasses.replace(privacy, release_mean=True)
        self.server_learning_rate = server_learning_rate
        self.stream_id = stream_id or f"{privacy.ledger_id}-stream"
        self.arrayrecord_key = arrayrecord_key
        self.poll_interval = poll_interval
        self.stopped: str | None = None  # why training ended early (the stream stopped), or None
        self.releases: list[StreamRelease] = []  # each release applied, in version order
        self.version = 0
        self.sent = self.submitted = self.refused = 0
        self._done = False  # start's loop ended: the release watcher ends too

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_versions: int, timeout: float = 3600,
              train_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Trains until ``num_versions`` versions are released (or the stream stops, or ``timeout`` seconds
        pass); returns the last model with ``evaluate_fn``'s metrics by version (before the first: 0)."""
        result = Result()
        model = {name: array.numpy() for name, array in initial_arrays.items()}
        floating = [name for name, a in model.items() if np.issubdtype(a.dtype, np.floating)]
        self.stream_id = self.client.create_stream(
            {name: model[name].shape for name in floating}, l2_norm_clip=self.clipping_norm, privacy=self.privacy,
            buffer=self.buffer, stream_id=self.stream_id)
        state = self.client.stream(self.stream_id)
        self.version = state.version
        kept = {self.version: model}  # the models nodes may be training from, by version
        if evaluate_fn is not None:
            self._evaluate(evaluate_fn, result, model)
        releases: queue.Queue = queue.Queue()
        watching = threading.Thread(target=self._watch, args=(releases,), name="clipd-flower-watch", daemon=True)
        watching.start()
        config = train_config if train_config is not None else ConfigRecord()
        nodes = list(grid.get_node_ids())
        idle: list[int] = list(nodes)
        parked: dict[int, int] = {}  # node -> the version from which it may take part again (0: never)
        in_flight: dict[str, tuple[int, int]] = {}  # message id -> (node, version it trains from)
        deadline = time.monotonic() + timeout
        log.info("clipd async: %d nodes, %d at once; stream %s releases every %d contributions", len(nodes),
                 self.concurrency, self.stream_id, self.buffer.size)
        while self.version < num_versions and self.stopped is None and time.monotonic() < deadline:
            for node, since in list(parked.items()):
                if since and self.version + 1 >= since:
                    del parked[node]
                    idle.append(node)
            while idle and len(in_flight) < self.concurrency:
                node = idle.pop(0)
                content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in model.items()}),
                                      "config": ConfigRecord({**config, VERSION_KEY: self.version})})
                message = grid.create_message(content, MessageType.TRAIN, node, group_id=str(self.version))
                for message_id in grid.push_messages([message]):
                    in_flight[message_id] = (node, self.version)
                    self.sent += 1
            replies = list(grid.pull_messages(list(in_flight))) if in_flight else []
            for reply in replies:
                node, trained_from = in_flight.pop(reply.metadata.reply_to_message_id)
                after = self._submit(reply, node, trained_from, kept, floating)
                if after is None:
                    idle.append(node)
                else:
                    parked[node] = after
            applied = self._apply(releases, model, kept, floating)
            if applied is not None:
                model = applied
                if evaluate_fn is not None:
                    self._evaluate(evaluate_fn, result, model)
            elif not replies:
                time.sleep(self.poll_interval)
        self._done = True
        result.arrays = ArrayRecord({name: Array(a) for name, a in model.items()})
        log.info("clipd async: %d versions released; %d updates sent to clipd (%d refused)%s", self.version,
                 self.submitted, self.refused, f"; stopped: {self.stopped}" if self.stopped else "")
        return result

    def _watch(self, releases: queue.Queue) -> None:
        """The stream's releases, each as it is made, into ``releases`` (a thread of its own)."""
        after = self.version
        while not self._done:
            try:
                for release in self.client.watch_releases(self.stream_id, after=after, timeout=5.0):
                    releases.put(release)
                    after = release.version
                    if self._done:
                        return
            except ClipdError as e:
                if getattr(e.code, "name", "") != "DEADLINE_EXCEEDED":
                    releases.put(e)
                    return
            if self._done:
                return
            state = self.client.stream(self.stream_id)
            if state.state != "open" and state.version <= after:
                releases.put(FailedPreconditionError(f"stream {self.stream_id} stopped: {state.reason}"))
                return

    def _apply(self, releases: queue.Queue, model: dict, kept: dict, floating: list[str]) -> dict | None:
        """The releases that came, applied in version order: the model after them (None: none came)."""
        changed = None
        while True:
            try:
                release = releases.get_nowait()
            except queue.Empty:
                return changed
            if isinstance(release, ClipdError):
                self.stopped = release.details
                return changed
            model = dict(model)
            for name in floating:
                step = np.asarray(release.sums[name], np.float64) * self.server_learning_rate
                model[name] = (model[name].astype(np.float64) + step).astype(model[name].dtype)
            self.releases.append(release)
            self.version = release.version
            kept[self.version] = model
            for old in [v for v in kept if v < self.version - self.buffer.max_staleness]:
                del kept[old]
            changed = model

    def _submit(self, reply: Message, node: int, trained_from: int, kept: dict, floating: list[str]) -> int | None:
        """Sends one reply's update to the stream; None, or the version from which the node may train again (0:
        never: its limit is reached)."""
        if reply.has_error():
            log.info("clipd async: node %s replied with an error (%s): nothing sent", node, reply.error.reason)
            return None
        records = reply.content.array_records
        record = records.get(self.arrayrecord_key) or (next(iter(records.values())) if len(records) == 1 else None)
        base = kept.get(trained_from)
        if record is None or base is None:
            log.info("clipd async: node %s: no arrays, or its model (version %s) is no longer kept: nothing sent",
                     node, trained_from)
            return None
        try:
            update = {name: np.subtract(record[name].numpy(), base[name], dtype=np.float64).astype(np.float32)
                      for name in floating}
        except (KeyError, ValueError) as e:
            log.warning("clipd async: node %s's reply does not hold the model's arrays (%s): nothing sent", node, e)
            return None
        client_id = f"n{node}"
        try:
            self.client.submit_to_stream(self.stream_id, update, trained_from=trained_from, client_id=client_id)
            self.submitted += 1
            return None
        except FailedPreconditionError as e:
            self.refused += 1
            if "stopped" in e.details:
                self.stopped = e.details
                return None
            if "stale" in e.details:
                return None  # it trains from the newest model next
            allowed = self.client.stream_client(self.stream_id, client_id).may_contribute_from
            log.info("clipd async: node %s: %s", node, e.details)
            return allowed  # (0: never again)

    def _evaluate(self, evaluate_fn, result: Result, model: dict) -> None:
        metrics = evaluate_fn(self.version, ArrayRecord({name: Array(a) for name, a in model.items()}))
        if metrics is not None:
            result.evaluate_metrics_serverapp[self.version] = metrics
