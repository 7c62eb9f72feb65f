"""The admin HTTP API (FastAPI): health, aggregation snapshots, Prometheus metrics, the dashboard.

The app is its routers (:mod:`.routers`: aggregations, ledgers, buffered streams, the server, metrics, pages)
over the server's facade (:mod:`.facade`), with one authentication: the admin token, as a bearer header or the
dashboard's session cookie. Every route reads host-side snapshots (``ServerFacade.stats``); none runs JAX.
"""

from __future__ import annotations

import dataclasses
import socket
import threading

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.staticfiles import StaticFiles

from clipd.server.admin import routers
from clipd.server.admin.apidocs import mount_docs
from clipd.server.admin.facade import ServerFacade, Settings, bearer_token, same
from clipd.server.admin.routers import SESSION_COOKIE, STATIC


def create_admin_app(server: ServerFacade, settings: Settings) -> FastAPI:
    """The admin app of a running server (its facade); ``settings`` decide its authentication."""
    app = FastAPI(title="clipd admin", version="1", description="Clip statistics of running aggregations.",
                  docs_url=None, redoc_url=None)  # /docs: apidocs.mount_docs, served without a CDN

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

    access = routers.Access(read=Depends(read_access), write=Depends(write_access))
    for make in (routers.server_state, routers.aggregations, routers.ledgers, routers.streams, routers.metrics):
        app.include_router(make(server, access))
    app.include_router(routers.pages(settings.admin_token))
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


def start_admin(server: ServerFacade, settings: Settings) -> AdminServer:
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
