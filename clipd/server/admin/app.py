"""The admin HTTP API (FastAPI): health, aggregation snapshots, Prometheus metrics, the dashboard.

Every route reads host-side snapshots (``Aggregation.stats()``); none runs JAX.
"""

import dataclasses
import math
import pathlib
import socket
import threading
import time
import urllib.parse
from typing import Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from clipd.server.admin.apidocs import mount_docs
from clipd.server.aggregations import THROUGHPUT_SECONDS, Aggregation, Stats
from clipd.server.credentials import bearer_token, same
from clipd.server.errors import NotFound
from clipd.server.settings import Settings

STATIC = pathlib.Path(__file__).resolve().parent / "static"
SESSION_COOKIE = "clipd_admin"
LOGIN_PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>clipd: sign in</title>
<link rel="stylesheet" href="/static/dashboard.css"></head><body><header><h1>clipd</h1></header><main>
<form method="post" action="/login"><label>Admin token <input type="password" name="token" autofocus></label>
<button type="submit">Sign in</button></form><!--error--></main></body></html>"""


def quantile_from_histogram(counts, upper_bounds, q: float) -> float | None:
    """The ``q`` quantile of norm/bound ratios from bucket counts, interpolated within a bucket.

    >>> quantile_from_histogram([0, 2, 2], [1.0, 2.0], 0.5)
    2.0
    """
    total = sum(counts)
    if total == 0:
        return None
    target, seen = q * total, 0
    for i, c in enumerate(counts):
        if c and seen + c >= target:
            lower = upper_bounds[i - 1] if i > 0 else 0.0
            upper = upper_bounds[i] if i < len(upper_bounds) else upper_bounds[-1] * 2
            return lower + (upper - lower) * (target - seen) / c
        seen += c
    return upper_bounds[-1]


def aggregation_view(aggregation: Aggregation) -> dict[str, Any]:
    """The JSON view of one aggregation: spec, policy, counters, per-layer statistics.

    Under a privacy policy (not in debug mode) the raw counters and statistics
    are absent (null): only the release's noised ones, under "privacy".
    """
    stats = aggregation.stats()
    view = _full_view(aggregation, stats)
    if aggregation.privacy is None:
        return view
    view["privacy"] = {
        "ledger_id": aggregation.privacy.ledger_id,
        "debug_raw_statistics": aggregation.privacy.debug_raw_statistics,
        "notice": stats.privacy_notice,
        "planned_ledger_epsilon": _json_float(aggregation.planned_epsilon),
        "mechanism": (aggregation.privacy.correlated.mechanism.value if aggregation.privacy.correlated is not None
                      else "independent"),
        "release": {k: _json_float(v) if isinstance(v, float) else v for k, v in stats.release.items()}
        if stats.release else None,
    }
    if aggregation.withheld:
        for key in RAW_FIELDS:
            view[key] = None
        view["layers"] = [{k: layer[k] for k in ("name", "shape", "dtype", "bound")} for layer in view["layers"]]
    return view


RAW_FIELDS = ("updated_unix_seconds", "examples", "batches", "bytes", "non_finite", "clipped", "examples_per_second",
              "example_norm_histogram", "clients")


def _full_view(aggregation: Aggregation, stats: Stats) -> dict[str, Any]:
    policy = aggregation.policy
    return {
        "aggregation_id": aggregation.id,
        "state": stats.state.value,
        "policy": {
            "kind": policy.kind.value,
            "l2_norm_clip": _json_float(policy.l2_norm_clip),
            "layer_clips": [_json_float(c) for c in policy.layer_clips],
            "rescale_to_unit_norm": policy.rescale_to_unit_norm,
            "non_finite": "reject" if aggregation.reject_non_finite else policy.non_finite.value,
        },
        "unit": aggregation.unit.value,
        "client_ids": aggregation.client_ids,
        "created_unix_seconds": aggregation.created,
        "finished_unix_seconds": aggregation.finished,
        "failure_reason": stats.failure_reason,
        "updated_unix_seconds": stats.updated_unix_seconds,
        "clients": stats.clients,
        "examples": stats.examples,
        "batches": stats.batches,
        "bytes": stats.bytes,
        "non_finite": stats.non_finite,
        "clipped": stats.clipped,
        "examples_per_second": stats.examples_per_second,
        "bucket_upper_bounds": list(stats.bucket_upper_bounds),
        "example_bound": _json_float(stats.example_bound),
        "example_norm_histogram": list(stats.example_norm_histogram),
        "layers": [
            {
                "name": layer.name,
                "shape": list(spec.shape),
                "dtype": spec.dtype,
                "bound": _json_float(layer.bound),
                "clipped": layer.clipped,
                "clip_fraction": layer.clipped / stats.examples if stats.examples else 0.0,
                "norm_mean": layer.norm_mean,
                "norm_max": layer.norm_max,
                "norm_histogram": list(layer.norm_histogram),
                "norm_ratio_quantiles": {
                    str(q): quantile_from_histogram(layer.norm_histogram, stats.bucket_upper_bounds, q)
                    for q in (0.5, 0.9, 0.99)
                },
            }
            for layer, spec in zip(stats.layers, aggregation.layers)
        ],
    }


def _ledger_view(ledger: dict, participation_refusals: dict[str, int]) -> dict[str, Any]:
    """A ledger's JSON view; ``participation_refusals``: every process's, by ledger (the server snapshot's)."""
    entries = [{**e, "epsilon_after": _json_float(e["epsilon_after"])} for e in ledger["entries"]]
    return {**{k: _json_float(v) if isinstance(v, float) else v for k, v in ledger.items()}, "entries": entries,
            "participation_refusals": participation_refusals.get(ledger["ledger_id"], 0)}


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # JSON has no inf or NaN


class _SnapshotCollector:
    """Prometheus metrics read from the snapshots at scrape time."""

    def __init__(self, server) -> None:
        self.server = server

    def collect(self):
        server = self.server
        views = [(a, a.stats()) for a in server.registry.all()]
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
        yield from _privacy_metrics(server, private, snapshot.participation_refusals)
        states = GaugeMetricFamily("clipd_aggregations", "Aggregations by state.", labels=["state"])
        for state in sorted({s.state.value for _, s in views}):
            states.add_metric([state], sum(s.state.value == state for _, s in views))
        yield states
        rejected = CounterMetricFamily("clipd_rejected_requests", "Requests refused, by gRPC status.",
                                       labels=["code"])
        for code, count in sorted(snapshot.rejections.items()):
            rejected.add_metric([code], count)
        yield rejected
        yield GaugeMetricFamily("clipd_active_streams", "Submit streams open (every process).",
                                value=snapshot.active_streams)
        yield GaugeMetricFamily("clipd_stream_limit", "Submit streams allowed at once (every process).",
                                value=snapshot.stream_limit)
        yield CounterMetricFamily("clipd_refused_streams", "Submit streams refused: every slot taken (every process).",
                                  value=snapshot.refused_streams)
        yield GaugeMetricFamily("clipd_buffered_bytes", "Bytes of partly received and queued batches (every process).",
                                value=snapshot.buffered_bytes)
        yield GaugeMetricFamily("clipd_buffer_limit_bytes", "The limit of clipd_buffered_bytes.",
                                value=snapshot.buffer_limit)
        yield CounterMetricFamily("clipd_refused_batches", "Batches refused: the buffer stayed full (every process).",
                                  value=snapshot.refused_batches)
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


def _privacy_metrics(server, private, participation_refusals: dict[str, int]):
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
                                  "Clients refused (by any process) because the ledger's stream does not let them"
                                  " take part in the release (min_separation, max_participations).",
                                  labels=["ledger"])
    for ledger_id in server.ledgers.ledger_ids():
        ledger = server.ledgers.describe(ledger_id)
        epsilon.add_metric([ledger_id], ledger["epsilon"])
        left.add_metric([ledger_id], ledger["budget_left"])
        releases.add_metric([ledger_id], len(ledger["entries"]))
        if ledger["stream"] is not None:
            stream_left.add_metric([ledger_id, ledger["mechanism"]], ledger["stream"]["left"])
            stream_bytes.add_metric([ledger_id, ledger["mechanism"]], ledger["stream"]["state_bytes"])
            refused.add_metric([ledger_id], participation_refusals.get(ledger_id, 0))
    yield from (epsilon, left, releases, stream_left, stream_bytes, refused)


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


def create_admin_app(server, settings: Settings) -> FastAPI:
    """The admin app of a running ``ClipdServer``; ``settings`` decide its authentication."""
    app = FastAPI(title="clipd admin", version="1", description="Clip statistics of running aggregations.",
                  docs_url=None, redoc_url=None)  # /docs: apidocs.mount_docs, served without a CDN
    registry = CollectorRegistry()
    registry.register(_SnapshotCollector(server))

    def check(token: str | None) -> None:
        if not settings.admin_token:
            return  # auth off (the server then listens on loopback only, unless told insecure)
        if token is None:
            raise HTTPException(401, "the admin credential is required ('Authorization: Bearer <token>')",
                                headers={"WWW-Authenticate": "Bearer"})
        if not same(token, settings.admin_token):
            raise HTTPException(403, "this credential may not do that")

    def read_access(request: Request) -> None:
        """Reads: the bearer header, or the dashboard's session cookie (set by POST /login)."""
        check(bearer_token(request.headers.items()) or request.cookies.get(SESSION_COOKIE))

    def write_access(request: Request) -> None:
        """Writes: the bearer header only (a cookie could be sent by a page of another site)."""
        check(bearer_token(request.headers.items()))

    def the_aggregation(aggregation_id: str) -> Aggregation:
        try:
            return server.registry.get(aggregation_id)
        except NotFound as e:
            raise HTTPException(404, str(e)) from None

    Reader = Annotated[None, Depends(read_access)]
    Writer = Annotated[None, Depends(write_access)]
    AggregationParam = Annotated[Aggregation, Depends(the_aggregation)]

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """Ready for new traffic: serving, and a Submit stream slot free (503 with the reason if not)."""
        snapshot = server.snapshot()
        reasons = []
        if not snapshot.serving:
            reasons.append("not serving (starting or stopping)")
        if snapshot.streams_saturated:
            reasons.append(f"all {snapshot.stream_limit} Submit stream slots are taken")
        body = {"ready": not reasons, "reasons": reasons,
                "streams": {"active": snapshot.active_streams, "limit": snapshot.stream_limit},
                "buffered_bytes": {"used": snapshot.buffered_bytes, "limit": snapshot.buffer_limit},
                "processes": [{"index": p["index"], "serving": p["serving"], "streams": p["streams"],
                               "buffered_bytes": p["buffered_bytes"]} for p in snapshot.shard_processes]}
        return JSONResponse(body, status_code=503 if reasons else 200)

    @app.get("/login", include_in_schema=False)
    def login_page() -> HTMLResponse:
        return HTMLResponse(LOGIN_PAGE)

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        """The dashboard's sign-in: the admin token from a form becomes an HttpOnly session cookie."""
        form = urllib.parse.parse_qs((await request.body()).decode("utf-8", "replace"))
        token = (form.get("token") or [""])[0]
        if settings.admin_token and not same(token, settings.admin_token):
            return HTMLResponse(LOGIN_PAGE.replace("<!--error-->", "<p class=error>Wrong token.</p>"), 403)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(SESSION_COOKIE, token, httponly=True, samesite="strict", path="/",
                            secure=request.url.scheme == "https")
        return response

    @app.post("/logout", include_in_schema=False)
    def logout() -> Response:
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    @app.get("/api/v1/aggregations")
    def list_aggregations(_: Reader) -> dict[str, Any]:
        aggregations = server.registry.all()
        debug = sorted({a.privacy.ledger_id for a in aggregations if a.privacy and a.privacy.debug_raw_statistics})
        return {"aggregations": [aggregation_view(a) for a in aggregations],
                "now_unix_seconds": time.time(),  # the server's clock: what ages are counted against
                "device_kind": server.snapshot().device_kind,
                "privacy_debug_notice": (f"DEBUG MODE: raw statistics of differentially private aggregations are shown;"
                                         f" the epsilon of ledger(s) {', '.join(debug)} is infinite") if debug else ""}

    @app.get("/api/v1/aggregations/{aggregation_id}")
    def get_aggregation(_: Reader, aggregation: AggregationParam) -> dict[str, Any]:
        return aggregation_view(aggregation)

    @app.get("/api/v1/aggregations/{aggregation_id}/throughput")
    def get_throughput(_: Reader, aggregation: AggregationParam) -> dict[str, Any]:
        """Examples per second, second by second, from the server's own series (``Aggregation.throughput``):
        the seconds in which examples arrived (the last ``THROUGHPUT_SECONDS``), 0 on each side of an idle gap;
        ``t`` is the second's start (unix time). The same on every read until more examples arrive. Under a
        privacy policy (not in debug mode) it is raw data: ``points`` and ``peak`` are null, ``withheld`` says
        why."""
        body: dict[str, Any] = {"aggregation_id": aggregation.id, "kept_seconds": THROUGHPUT_SECONDS}
        if aggregation.withheld:
            return {**body, "points": None, "peak_examples_per_second": None, "truncated": None,
                    "withheld": "withheld: the throughput of a differentially private aggregation is a raw"
                                " statistic (examples counted second by second)"}
        points, truncated = aggregation.throughput()
        return {**body, "points": [{"t": t, "examples_per_second": n} for t, n in points],
                "peak_examples_per_second": max((n for _, n in points), default=0), "truncated": truncated,
                "withheld": None}

    @app.delete("/api/v1/aggregations/{aggregation_id}")
    def cancel_aggregation(_: Writer, aggregation: AggregationParam) -> dict[str, Any]:
        return aggregation_view(server.lifecycle.cancel(aggregation.id))

    @app.get("/api/v1/server")
    def server_view(_: Reader) -> dict[str, Any]:
        """The whole server: its uptime; Submit streams, buffered bytes and refusals summed over every process
        that receives (this one, or its shard processes); the devices in use (a device worker each) and the
        clip-and-sum steps each has run; the shard processes (``--processes``) or Ray shard hosts (``--ray``),
        each with its own streams, buffers, refusals, restarts (start-up retries included) and the calls it
        forwarded to this process; the Submit payload bytes this process received itself (0 with shard
        processes or hosts: they receive them) and, with those, the payload bytes they received."""
        snapshot = server.snapshot()
        return {"serving": snapshot.serving, "started_unix_seconds": snapshot.started_unix_seconds,
                "uptime_seconds": max(0.0, time.time() - snapshot.started_unix_seconds),
                "streams": {"active": snapshot.active_streams, "limit": snapshot.stream_limit,
                            "refused": snapshot.refused_streams},
                "buffered_bytes": {"used": snapshot.buffered_bytes, "limit": snapshot.buffer_limit},
                "refused_batches": snapshot.refused_batches, "rejections": dict(sorted(snapshot.rejections.items())),
                "participation_refusals": dict(sorted(snapshot.participation_refusals.items())),
                "queue_depth": snapshot.queue_depth, "queued_bytes": snapshot.queued_bytes,
                "device_kind": snapshot.device_kind, "devices": snapshot.devices,
                "restarts": snapshot.restarts, "shard_processes": snapshot.shard_processes,
                "payload_bytes_received": snapshot.payload_bytes_received,
                "shard_payload_bytes": snapshot.shard_payload_bytes}

    @app.get("/api/v1/ledgers")
    def list_ledgers(_: Reader) -> dict[str, Any]:
        refusals = server.snapshot().participation_refusals
        return {"ledgers": [_ledger_view(server.ledgers.describe(i), refusals) for i in server.ledgers.ledger_ids()]}

    @app.get("/api/v1/ledgers/{ledger_id}")
    def get_ledger(_: Reader, ledger_id: str) -> dict[str, Any]:
        ledger = server.ledgers.describe(ledger_id)
        if ledger is None:
            raise HTTPException(404, f"no ledger {ledger_id!r}")
        return _ledger_view(ledger, server.snapshot().participation_refusals)

    @app.get("/metrics")
    def metrics(_: Reader) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    mount_docs(app)  # /docs, /docs/openapi.json, /docs/assets: open, they hold no data
    return app


@dataclasses.dataclass
class AdminServer:
    """uvicorn serving the admin app in a background thread."""

    server: uvicorn.Server
    thread: threading.Thread
    port: int
    scheme: str = "http"  # "https" when the server has a TLS certificate

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


def start_admin(server, settings: Settings) -> AdminServer:
    """Starts the admin API on ``settings.host:settings.admin_port`` (0 picks a free port).

    With ``tls_cert_file`` set it serves HTTPS with the gRPC certificate and key.
    It never asks for client certificates, even when gRPC requires them
    (``tls_client_ca_file``): the admin API authenticates with the bearer token.
    """
    from clipd.server.tls import admin_ssl_kwargs

    app = create_admin_app(server, settings)
    ssl_kwargs = admin_ssl_kwargs(settings)
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.admin_port))
    # log_config=None: uvicorn's records go through our handler (text or JSON lines), not its own.
    config = uvicorn.Config(app, log_level="warning", access_log=False, log_config=None, **ssl_kwargs)
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="clipd-admin", daemon=True)
    thread.start()
    while not uv.started and thread.is_alive():
        threading.Event().wait(0.01)
    return AdminServer(uv, thread, sock.getsockname()[1], "https" if ssl_kwargs else "http")
