"""Every kind of shards keeps one contract (tests/shards_contract.py): this process's devices, shard processes.

Ray shard hosts run the same contract in tests/test_ray.py, beside its Ray cluster.
"""

from __future__ import annotations

import pytest
from conftest import TEST_SETTINGS
from shards_contract import check_shards_contract

from clipd.server.app import create_server
from clipd.server.settings import Settings


@pytest.mark.parametrize("kind", [dict(), dict(processes=2)], ids=["local-devices", "shard-processes"])
def test_every_kind_of_shards_keeps_the_contract(kind, tmp_path):
    server, port = create_server(Settings(**{**TEST_SETTINGS, "data_dir": str(tmp_path / "data"), "shards": 2,
                                             **kind}))
    try:
        check_shards_contract(server, f"127.0.0.1:{port}")
    finally:
        server.stop(1.0)
