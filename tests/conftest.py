"""Shared fixtures: a real clipd server on loopback (ephemeral port) and a real client."""

from __future__ import annotations

import pytest

from clipd.client import Client
from clipd.server.app import create_server
from clipd.server.settings import Settings

TEST_SETTINGS = dict(host="127.0.0.1", grpc_port=0, admin_port=-1, max_device_rows=16,
                     max_message_bytes=4 << 20, max_aggregations=1000, data_dir="memory")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server with a real (SQLite) store in a fresh directory: acknowledgements wait for checkpoints."""
    data_dir = tmp_path_factory.mktemp("clipd-data")
    server, _ = create_server(Settings(**{**TEST_SETTINGS, "data_dir": str(data_dir)}))
    yield server
    server.stop(grace=1.0)


@pytest.fixture()
def client(server):
    with Client(f"127.0.0.1:{server.port}", message_bytes=64 << 10, max_message_bytes=4 << 20) as client:
        yield client
