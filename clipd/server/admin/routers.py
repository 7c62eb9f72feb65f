"""The admin API's routes, one router a subject: aggregations, ledgers, buffered streams, the server, metrics, pages.

Each router is made over the server's facade (:class:`~clipd.server.admin.facade.ServerFacade`) and the app's
two access checks (``Access``: read, by the bearer header or the dashboard's session cookie; write, by the
header only); every route reads host-side snapshots and none runs JAX. (No ``from __future__ import
annotations`` here: FastAPI reads the routes' annotations, some of them local to the function that makes the
router.)
"""


import dataclasses
import pathlib
import time
import urllib.parse
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from clipd.server.admin.facade import THROUGHPUT_SECONDS, Aggregation, NotFound, ServerFacade, same
from clipd.server.admin.metrics import SnapshotCollector
from clipd.server.admin.views import aggregation_view, ledger_view, stream_view

STATIC = pathlib.Path(__file__).resolve().parent / "static"
SESSION_COOKIE = "clipd_admin"
LOGIN_PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>clipd: sign in</title>
<link rel="stylesheet" href="/static/dashboard.css"></head><body><header><h1>clipd</h1></header><main>
<form method="post" action="/login"><label>Admin token <input type="password" name="token" autofocus></label>
<button type="submit">Sign in</button></form><!--error--></main></body></html>"""


@dataclasses.dataclass(frozen=True)
class Access:
    """The app's access checks, as FastAPI dependencies."""

    read: Any  # Depends(...) of a read
    write: Any  # Depends(...) of a write


def aggregations(server: ServerFacade, access: Access) -> APIRouter:
    """``/api/v1/aggregations``: the list, one, its throughput series, and DELETE (cancel)."""
    router = APIRouter(prefix="/api/v1/aggregations")

    def the_aggregation(aggregation_id: str) -> Aggregation:
        try:
            return server.aggregation(aggregation_id)
        except NotFound as e:
            raise HTTPException(404, str(e)) from None

    AggregationParam = Annotated[Aggregation, Depends(the_aggregation)]

    @router.get("", dependencies=[access.read])
    def list_aggregations() -> dict[str, Any]:
        listed = server.aggregations()
        debug = sorted({a.privacy.ledger_id for a in listed if a.privacy and a.privacy.debug_raw_statistics})
        return {"aggregations": [aggregation_view(a, server.stats(a)) for a in listed],
                "now_unix_seconds": time.time(),  # the server's clock: what ages are counted against
                "device_kind": server.snapshot().device_kind,
                "privacy_debug_notice": (f"DEBUG MODE: raw statistics of differentially private aggregations are shown;"
                                         f" the epsilon of ledger(s) {', '.join(debug)} is infinite") if debug else ""}

    @router.get("/{aggregation_id}", dependencies=[access.read])
    def get_aggregation(aggregation: AggregationParam) -> dict[str, Any]:
        return aggregation_view(aggregation, server.stats(aggregation))

    @router.get("/{aggregation_id}/throughput", dependencies=[access.read])
    def get_throughput(aggregation: AggregationParam) -> dict[str, Any]:
        """Examples per second, second by second, from the series counted where it is summed (``Progress.throughput``):
        the seconds in which examples arrived (the last ``THROUGHPUT_SECONDS``), 0 on each side of an idle gap;
        ``t`` is the second's start (unix time). The same on every read until more examples arrive. Under a
        privacy policy (not in debug mode) it is raw data: ``points`` and ``peak`` are null, ``withheld`` says
        why."""
        body: dict[str, Any] = {"aggregation_id": aggregation.id, "kept_seconds": THROUGHPUT_SECONDS}
        if aggregation.withheld:
            return {**body, "points": None, "peak_examples_per_second": None, "truncated": None,
                    "withheld": "withheld: the throughput of a differentially private aggregation is a raw"
                                " statistic (examples counted second by second)"}
        points, truncated = server.throughput(aggregation)
        return {**body, "points": [{"t": t, "examples_per_second": n} for t, n in points],
                "peak_examples_per_second": max((n for _, n in points), default=0), "truncated": truncated,
                "withheld": None}

    @router.delete("/{aggregation_id}", dependencies=[access.write])
    def cancel_aggregation(aggregation: AggregationParam) -> dict[str, Any]:
        cancelled = server.cancel(aggregation.id)
        return aggregation_view(cancelled, server.stats(cancelled))

    return router


def ledgers(server: ServerFacade, access: Access) -> APIRouter:
    """``/api/v1/ledgers``: every privacy ledger, and one."""
    router = APIRouter(prefix="/api/v1/ledgers")

    @router.get("", dependencies=[access.read])
    def list_ledgers() -> dict[str, Any]:
        refusals = dict(server.snapshot().load.participation_refusals)
        described = (server.ledger(i) for i in server.ledger_ids())
        return {"ledgers": [ledger_view(ledger, refusals) for ledger in described if ledger is not None]}

    @router.get("/{ledger_id}", dependencies=[access.read])
    def get_ledger(ledger_id: str) -> dict[str, Any]:
        ledger = server.ledger(ledger_id)
        if ledger is None:
            raise HTTPException(404, f"no ledger {ledger_id!r}")
        return ledger_view(ledger, dict(server.snapshot().load.participation_refusals))

    return router


def streams(server: ServerFacade, access: Access) -> APIRouter:
    """``/api/v1/streams``: every buffered stream, and one: its state, newest version, the open buffer's fill, its
    rules, releases per minute, its contributions by staleness (since the server started), its ledger's epsilon."""
    router = APIRouter(prefix="/api/v1/streams")

    @router.get("", dependencies=[access.read])
    def list_streams() -> dict[str, Any]:
        return {"streams": [stream_view(s) for s in server.buffered_streams()]}

    @router.get("/{stream_id}", dependencies=[access.read])
    def get_stream(stream_id: str) -> dict[str, Any]:
        found = [s for s in server.buffered_streams() if s["stream_id"] == stream_id]
        if not found:
            raise HTTPException(404, f"no stream {stream_id!r}")
        return stream_view(found[0])

    return router


def server_state(server: ServerFacade, access: Access) -> APIRouter:
    """``/healthz``, ``/readyz`` and ``/api/v1/server``: the server as a whole."""
    router = APIRouter()

    @router.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/readyz")
    def readyz() -> JSONResponse:
        """Ready for new traffic: serving, and a Submit stream slot free (503 with the reason if not)."""
        snapshot = server.snapshot()
        load = snapshot.load
        reasons = []
        if not snapshot.serving:
            reasons.append("not serving (starting or stopping)")
        if snapshot.streams_saturated:
            reasons.append(f"all {load.stream_limit} Submit stream slots are taken")
        body = {"ready": not reasons, "reasons": reasons,
                "streams": {"active": load.active_streams, "limit": load.stream_limit},
                "buffered_bytes": {"used": load.buffered_bytes, "limit": load.buffer_limit},
                "processes": [{"index": p["index"], "serving": p["serving"], "streams": p["streams"],
                               "buffered_bytes": p["buffered_bytes"]} for p in snapshot.shard_processes]}
        return JSONResponse(body, status_code=503 if reasons else 200)

    @router.get("/api/v1/server", dependencies=[access.read])
    def server_view() -> dict[str, Any]:
        """The whole server: its uptime; Submit streams, buffered bytes and refusals summed over every process
        that receives (this one, or its shard processes); its one-message submissions (held: running or waiting
        for a worker; the limit of those; refused with an appointment); the devices in use (a device worker each)
        and the clip-and-sum steps each has run; the shard processes (``--processes``) or Ray shard hosts (``--ray``),
        each with its own streams, buffers, refusals, restarts (start-up retries included) and the calls it
        forwarded to this process; the Submit payload bytes this process received itself (0 with shard
        processes or hosts: they receive them) and, with those, the payload bytes they received; what ``clipd
        serve`` set at start-up (``process_tuning``: glibc's malloc thresholds and OpenBLAS's threads, each
        with its value and its source, ``mallopt`` or ``environment``; empty in an embedded server)."""
        snapshot = server.snapshot()
        load = snapshot.load
        return {"serving": snapshot.serving, "started_unix_seconds": snapshot.started_unix_seconds,
                "uptime_seconds": max(0.0, time.time() - snapshot.started_unix_seconds),
                "streams": {"active": load.active_streams, "limit": load.stream_limit,
                            "refused": load.refused_streams},
                "one_message": {"held": load.one_message_held, "limit": load.one_message_limit,
                                "refused": load.refused_one_message},
                "buffered_bytes": {"used": load.buffered_bytes, "limit": load.buffer_limit},
                "refused_batches": load.refused_batches, "rejections": dict(sorted(load.rejections.items())),
                "participation_refusals": dict(sorted(load.participation_refusals.items())),
                "queue_depth": snapshot.queue_depth, "queued_bytes": snapshot.queued_bytes,
                "device_kind": snapshot.device_kind, "devices": snapshot.devices,
                "restarts": snapshot.restarts, "shard_processes": snapshot.shard_processes,
                "payload_bytes_received": snapshot.payload_bytes_received,
                "shard_payload_bytes": snapshot.shard_payload_bytes, "process_tuning": snapshot.process_tuning}

    return router


def metrics(server: ServerFacade, access: Access) -> APIRouter:
    """``/metrics``: Prometheus' text format, read from the snapshots at scrape time."""
    router = APIRouter()
    registry = CollectorRegistry()  # this app's own: a test's app never sees another's metrics
    registry.register(SnapshotCollector(server))

    @router.get("/metrics", dependencies=[access.read])
    def prometheus() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


def pages(admin_token: str) -> APIRouter:
    """The dashboard and its sign-in (the admin token from a form becomes an HttpOnly session cookie)."""
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    def dashboard() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html")

    @router.get("/login")
    def login_page() -> HTMLResponse:
        return HTMLResponse(LOGIN_PAGE)

    @router.post("/login")
    async def login(request: Request) -> Response:
        form = urllib.parse.parse_qs((await request.body()).decode("utf-8", "replace"))
        token = (form.get("token") or [""])[0]
        if admin_token and not same(token, admin_token):
            return HTMLResponse(LOGIN_PAGE.replace("<!--error-->", "<p class=error>Wrong token.</p>"), 403)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(SESSION_COOKIE, token, httponly=True, samesite="strict", path="/",
                            secure=request.url.scheme == "https")
        return response

    @router.post("/logout")
    def logout() -> Response:
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    return router
