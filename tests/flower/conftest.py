"""Fixtures of the Flower tests. They run in .cache/flower-venv (flwr 1.41, clipd without the server extra):
``bash scripts/test.sh`` builds it and runs them there, after the main suite. The clipd server runs as a
subprocess with the main environment's Python, ``CLIPD_SERVER_PYTHON`` (it can't live here: protobuf 7).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("flwr", reason="tests/flower runs in .cache/flower-venv: bash scripts/test.sh")

from flower_helpers import ServerProcess  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from clipd.client import Client  # noqa: E402


@pytest.fixture(scope="session")
def server_python() -> str:
    python = os.environ.get("CLIPD_SERVER_PYTHON")
    if not python:
        pytest.skip("CLIPD_SERVER_PYTHON (a Python with clipd's server extra) is not set: run bash scripts/test.sh")
    return python


@pytest.fixture(scope="session")
def clipd_server(server_python, tmp_path_factory) -> ServerProcess:
    server = ServerProcess(server_python, tmp_path_factory.mktemp("clipd-server"))
    yield server
    server.stop()


ADMIN_TOKEN = "flower-admin-7d2e"  # the admin credential of ``auth_clipd_server``


@pytest.fixture(scope="session")
def auth_clipd_server(server_python, tmp_path_factory) -> ServerProcess:
    """A clipd server with an admin token: client ids from credentials (what the server's draws need)."""
    server = ServerProcess(server_python, tmp_path_factory.mktemp("clipd-auth-server"), "--admin-token",
                           ADMIN_TOKEN)
    yield server
    server.stop()


@pytest.fixture()
def admin_client(auth_clipd_server) -> Client:
    with Client(auth_clipd_server.target, token=ADMIN_TOKEN, retry_timeout=20.0) as client:
        yield client


@pytest.fixture()
def client(clipd_server) -> Client:
    with Client(clipd_server.target, retry_timeout=20.0) as client:
        yield client


@pytest.fixture(autouse=True, scope="session")
def task_identity():
    """Flower's Message needs the run it belongs to: what flwr's run_simulation sets for its ServerApp."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield


