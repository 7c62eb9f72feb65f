"""The admin API's Prometheus metrics: a collector that reads the server's snapshots at scrape time."""

from __future__ import annotations

import math
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from clipd.server.admin.facade import ServerFacade, Stats


class SnapshotCollector:
    """Prometheus metrics read from the snapshots at scrape time."""

    def __init__(self, server: ServerFacade) -> None:
        self.server = server

    def collect(self):
        server = self.server
        views = [(a, server.stats(a)) for a in server.aggregations()]
        examples = CounterMetricFamily("clipd_examples", "Examples accumulated.", labels=["aggregation"])
        batches = CounterMetricFamily("clipd_batches", "Batches accumulated.", labels=["aggregation"])
        received = CounterMetricFamily("clipd_received_bytes", "Update bytes accumulated.", labels=["aggregation"])
        non_finite = CounterMetricFamily("clipd_non_finite_examples", "Examples with NaN or inf.",
                                         labels=["aggregation"])
        clipped = CounterMetricFamily("clipd_clipped_examples", "Examples whose layer was scaled down.",
                                      labels=["aggregation", "layer"])
        bound = GaugeMetricFamily("clipd_layer_bound", "The L2 bound of each layer.", labels=["aggregation", "layer"])
        norms = HistogramMetricFamily("clipd_layer_norm_ratio", "Per-example layer norm divided by the layer bound.",
                                      labels=["aggregation", "layer"])
        rate = GaugeMetricFamily("clipd_examples_per_second", "Recent throughput.", labels=["aggregation"])
        private = [(a, s) for a, s in views if a.privacy is not None]
        for aggregation, stats in views:
            a = aggregation.id
            if aggregation.withheld:  # its released, noised statistics only (below)
                for layer in stats.layers:
                    bound.add_metric([a, layer.name], layer.bound)
                continue
            examples.add_metric([a], stats.examples)
            batches.add_metric([a], stats.batches)
            received.add_metric([a], stats.bytes)
            non_finite.add_metric([a], stats.non_finite)
            rate.add_metric([a], stats.examples_per_second)
            for layer in stats.layers:
                clipped.add_metric([a, layer.name], layer.clipped)
                bound.add_metric([a, layer.name], layer.bound)
                norms.add_metric([a, layer.name], _cumulative(layer.norm_histogram, stats.bucket_upper_bounds),
                                 sum_value=_ratio_sum(layer, stats))
        yield from (examples, batches, received, non_finite, clipped, bound, norms, rate)
        snapshot = server.snapshot()
        yield from _privacy_metrics(server, private, dict(snapshot.load.participation_refusals))
        yield from _buffered_stream_metrics(server.buffered_streams())
        states = GaugeMetricFamily("clipd_aggregations", "Aggregations by state.", labels=["state"])
        for state in sorted({s.state.value for _, s in views}):
            states.add_metric([state], sum(s.state.value == state for _, s in views))
        yield states
        rejected = CounterMetricFamily("clipd_rejected_requests", "Requests refused, by gRPC status.",
                                       labels=["code"])
        for code, count in sorted(snapshot.load.rejections.items()):
            rejected.add_metric([code], count)
        yield rejected
        yield GaugeMetricFamily("clipd_active_streams", "Submit streams open (every process).",
                                value=snapshot.load.active_streams)
        yield GaugeMetricFamily("clipd_stream_limit", "Submit streams allowed at once (every process).",
                                value=snapshot.load.stream_limit)
        yield CounterMetricFamily("clipd_refused_streams", "Submit streams refused: every slot taken (every process).",
                                  value=snapshot.load.refused_streams)
        yield GaugeMetricFamily("clipd_one_message_held", "One-message submissions (SubmitOne) running or waiting"
                                " for a worker (every process).", value=snapshot.load.one_message_held)
        yield GaugeMetricFamily("clipd_one_message_limit", "One-message submissions that may be held: workers and"
                                " queue (every process).", value=snapshot.load.one_message_limit)
        yield CounterMetricFamily("clipd_refused_one_message", "One-message submissions refused with an appointment:"
                                  " the queue was full (every process).", value=snapshot.load.refused_one_message)
        yield GaugeMetricFamily("clipd_buffered_bytes", "Bytes of partly received and queued batches (every process).",
                                value=snapshot.load.buffered_bytes)
        yield GaugeMetricFamily("clipd_buffer_limit_bytes", "The limit of clipd_buffered_bytes.",
                                value=snapshot.load.buffer_limit)
        yield CounterMetricFamily("clipd_refused_batches", "Batches refused: the buffer stayed full (every process).",
                                  value=snapshot.load.refused_batches)
        yield GaugeMetricFamily("clipd_start_time_seconds", "When the server started (unix time).",
                                value=snapshot.started_unix_seconds)
        yield GaugeMetricFamily("clipd_uptime_seconds", "Seconds since the server started.",
                                value=max(0.0, time.time() - snapshot.started_unix_seconds))
        yield from _process_metrics(snapshot.shard_processes)
        yield GaugeMetricFamily("clipd_queue_depth", "Items waiting for the device worker.",
                                value=snapshot.queue_depth)
        yield GaugeMetricFamily("clipd_queued_bytes", "Batch bytes waiting for the device.",
                                value=snapshot.queued_bytes)
        device = GaugeMetricFamily("clipd_device_info", "The devices the workers run on.", labels=["id", "kind"])
        steps = CounterMetricFamily("clipd_device_steps", "Clip-and-sum steps run, by device.", labels=["id"])
        for d in snapshot.devices:
            device.add_metric([str(d["id"]), d["kind"]], 1)
            steps.add_metric([str(d["id"])], d["steps"])
        yield device
        yield steps


def _process_metrics(processes: list[dict]):
    """Each shard process's (or Ray shard host's) share of the server's totals, and its restarts; the families
    are there, empty, without them."""
    labels = ["process"]
    up = GaugeMetricFamily("clipd_shard_process_up", "1: the shard process is alive and serving.", labels=labels)
    restarts = CounterMetricFamily("clipd_shard_process_restarts",
                                   "Times a shard process was started again (after it exited, or a failed start).",
                                   labels=labels)
    streams = GaugeMetricFamily("clipd_shard_process_active_streams", "Submit streams open on a shard process.",
                                labels=labels)
    limit = GaugeMetricFamily("clipd_shard_process_stream_limit", "Submit streams a shard process allows at once.",
                              labels=labels)
    refused = CounterMetricFamily("clipd_shard_process_refused_streams",
                                  "Submit streams a shard process refused: every slot taken.", labels=labels)
    buffered = GaugeMetricFamily("clipd_shard_process_buffered_bytes",
                                 "Bytes of partly received and queued batches on a shard process.", labels=labels)
    rejected = CounterMetricFamily("clipd_shard_process_rejected_requests",
                                   "Requests a shard process refused, by gRPC status.", labels=["process", "code"])
    for process in processes:
        index = [str(process["index"])]
        up.add_metric(index, int(bool(process["alive"] and process["serving"])))
        restarts.add_metric(index, process["restarts"])
        if process.get("streams") is None:  # no statistics from it yet
            continue
        streams.add_metric(index, process["streams"]["active"])
        limit.add_metric(index, process["streams"]["limit"])
        refused.add_metric(index, process["streams"]["refused"])
        buffered.add_metric(index, process["buffered_bytes"]["used"])
        for code, count in process["rejections"].items():
            rejected.add_metric([*index, code], count)
    yield from (up, restarts, streams, limit, refused, buffered, rejected)


def _privacy_metrics(server: ServerFacade, private, participation_refusals: dict[str, int]):
    """Released (noised) statistics of private aggregations, debug flags, and each ledger's epsilon."""
    released = GaugeMetricFamily("clipd_released_examples", "Noised count of a private release.",
                                 labels=["aggregation", "ledger"])
    released_clipped = GaugeMetricFamily("clipd_released_clipped", "Noised per-layer clip count of a private release.",
                                         labels=["aggregation", "ledger", "layer"])
    noise = GaugeMetricFamily("clipd_release_noise_stddev", "Noise stddev per coordinate of a private release's sum.",
                              labels=["aggregation", "ledger"])
    debug = GaugeMetricFamily("clipd_privacy_debug",
                              "1: a private aggregation shows raw statistics (epsilon infinite).",
                              labels=["aggregation", "ledger"])
    for aggregation, stats in private:
        labels = [aggregation.id, aggregation.privacy.ledger_id]
        debug.add_metric(labels, int(aggregation.privacy.debug_raw_statistics))
        if stats.release:
            noise.add_metric(labels, stats.release["noise_stddev"])
            if stats.release["statistics_noise_stddev"] > 0:
                released.add_metric(labels, stats.release["examples"])
                for layer, value in zip(stats.layers, stats.release["layer_clipped"]):
                    released_clipped.add_metric([*labels, layer.name], value)
    yield from (released, released_clipped, noise, debug)
    epsilon = GaugeMetricFamily("clipd_ledger_epsilon", "Epsilon spent by a privacy ledger (at its delta).",
                                labels=["ledger"])
    left = GaugeMetricFamily("clipd_ledger_budget_left", "max_epsilon minus epsilon spent (+Inf: no budget).",
                             labels=["ledger"])
    releases = GaugeMetricFamily("clipd_ledger_entries", "Accounted events of a privacy ledger.", labels=["ledger"])
    stream_left = GaugeMetricFamily("clipd_ledger_stream_releases_left",
                                    "Releases a correlated noise stream has left of those it was planned for.",
                                    labels=["ledger", "mechanism"])
    stream_bytes = GaugeMetricFamily("clipd_ledger_stream_state_bytes",
                                     "What a correlated noise stream's state takes in the store.",
                                     labels=["ledger", "mechanism"])
    refused = CounterMetricFamily("clipd_ledger_participation_refusals",
                                  "Clients refused (by any process) because the ledger's rules keep them out of the"
                                  " release: its stream's participation (min_separation, max_participations), or"
                                  " the server's draws (sampling drawn by the server).",
                                  labels=["ledger"])
    audited = GaugeMetricFamily("clipd_ledger_audit_epsilon", "A ledger's canary audit: the epsilon claimed over"
                                " the releases it covers, and (closed) the lower bound it shows at its confidence"
                                " and the most its canaries can show.", labels=["ledger", "bound"])
    audit_releases = GaugeMetricFamily("clipd_ledger_audit_releases", "Releases a ledger's canary audit covers;"
                                       " closed 1 once it is closed.", labels=["ledger", "closed"])
    refuted = GaugeMetricFamily("clipd_ledger_audit_refuted", "1 when a closed audit's lower bound passes the"
                                " claimed epsilon: the noise is less than the ledger says (a privacy bug).",
                                labels=["ledger"])
    for ledger_id in server.ledger_ids():
        ledger = server.ledger(ledger_id)
        if ledger is None:  # (gone since it was listed)
            continue
        epsilon.add_metric([ledger_id], ledger["epsilon"])
        left.add_metric([ledger_id], ledger["budget_left"])
        releases.add_metric([ledger_id], len(ledger["entries"]))
        if ledger["stream"] is not None:
            stream_left.add_metric([ledger_id, ledger["mechanism"]], ledger["stream"]["left"])
            stream_bytes.add_metric([ledger_id, ledger["mechanism"]], ledger["stream"]["state_bytes"])
            refused.add_metric([ledger_id], participation_refusals.get(ledger_id, 0))
        audit = ledger.get("audit")
        if audit is not None:
            audited.add_metric([ledger_id, "claimed"], audit["epsilon_claimed"])
            audit_releases.add_metric([ledger_id, str(int(audit["closed"]))], audit["releases"])
            if audit["closed"]:
                audited.add_metric([ledger_id, "lower"], audit["epsilon_lower"])
                audited.add_metric([ledger_id, "ceiling"], audit["epsilon_ceiling"])
                refuted.add_metric([ledger_id], float(audit["refuted"]))
    yield from (epsilon, left, releases, stream_left, stream_bytes, refused, audited, audit_releases, refuted)


STALENESS_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50, 100)


def _buffered_stream_metrics(streams: list[dict]):
    """Each buffered stream: its newest version, whether it is open, the open buffer's fill and size, releases per
    minute, and its accepted contributions' staleness (since this server started)."""
    labels = ["stream", "ledger"]
    version = GaugeMetricFamily("clipd_buffered_stream_version", "The newest version a buffered stream released.",
                                labels=labels)
    is_open = GaugeMetricFamily("clipd_buffered_stream_open", "1 while a buffered stream takes contributions, 0 once"
                                " stopped.", labels=labels)
    filled = GaugeMetricFamily("clipd_buffered_stream_buffer_filled", "Contributions taken into the buffer being"
                               " filled.", labels=labels)
    size = GaugeMetricFamily("clipd_buffered_stream_buffer_size", "Contributions that release a buffer (K).",
                             labels=labels)
    rate = GaugeMetricFamily("clipd_buffered_stream_releases_per_minute", "Releases per minute over a stream's last"
                             " ten.", labels=labels)
    staleness = HistogramMetricFamily("clipd_buffered_stream_staleness", "Versions between the one a contribution"
                                      " trained from and the one before its buffer's (accepted contributions).",
                                      labels=labels)
    for stream in streams:
        key = [stream["stream_id"], stream["ledger_id"]]
        version.add_metric(key, stream["version"])
        is_open.add_metric(key, float(stream["state"] == "open"))
        filled.add_metric(key, stream["buffer"]["filled"])
        size.add_metric(key, stream["buffer"]["size"])
        rate.add_metric(key, stream["releases_per_minute"])
        counts = {int(t): n for t, n in stream["staleness"]["by_staleness"].items()}
        buckets = [(str(le), float(sum(n for t, n in counts.items() if t <= le))) for le in STALENESS_BUCKETS]
        staleness.add_metric(key, [*buckets, ("+Inf", float(sum(counts.values())))],
                             sum_value=float(sum(t * n for t, n in counts.items())))
    yield from (version, is_open, filled, size, rate, staleness)


def _cumulative(counts, upper_bounds) -> list[tuple[str, float]]:
    buckets, total = [], 0
    for le, count in zip([*map(str, upper_bounds), "+Inf"], counts):
        total += count
        buckets.append((le, total))
    return buckets


def _ratio_sum(layer, stats: Stats) -> float:
    counted = sum(layer.norm_histogram)
    if not counted or not (0 < layer.bound < math.inf):
        return 0.0
    return layer.norm_mean * counted / layer.bound
