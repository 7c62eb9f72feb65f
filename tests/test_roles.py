"""Roles over real gRPC: the admin credential, per-aggregation submit tokens, and no credential."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from conftest import ADMIN_TOKEN as ADMIN
from conftest import TEST_SETTINGS
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clipd.client import Client, PermissionDeniedError, UnauthenticatedError
from clipd.server.app import create_server
from clipd.server.settings import Settings

LAYERS = {"w": (4,)}


def target_of(server) -> str:
    return f"127.0.0.1:{server.port}"


def client(target, token):
    return Client(target, token=token, retry_timeout=0.5)


def test_a_submit_token_submits_to_its_aggregation_and_does_nothing_else(auth_server):
    target = target_of(auth_server)
    with client(target, ADMIN) as admin:
        mine = admin.create_aggregation(LAYERS, l2_norm_clip=float("inf"))
        other = admin.create_aggregation(LAYERS)
        token = admin.get_aggregation(mine).submit_token
        other_token = admin.get_aggregation(other).submit_token
    assert token.startswith("cst1_") and token != other_token
    ones = {"w": np.ones((3, 4), np.float32)}
    with client(target, token) as participant:
        assert participant.submit(mine, ones).examples == 3
        spec = participant.get_aggregation(mine)  # the spec, to check updates against
        assert [tuple(layer.shape) for layer in spec.layers] == [(4,)]
        assert spec.submit_token == "" and spec.examples == 0  # no token, no statistics
        with pytest.raises(PermissionDeniedError):
            participant.submit(other, ones)
        with pytest.raises(PermissionDeniedError):
            participant.get_aggregation(other)
        with pytest.raises(PermissionDeniedError):
            participant.get_aggregation("no-such-aggregation")  # unknown ids look the same as others'
        for call in (lambda: participant.finalize(mine), lambda: participant.cancel(mine),
                     lambda: participant.stats(mine), participant.list_aggregations,
                     lambda: participant.create_aggregation(LAYERS)):
            with pytest.raises(PermissionDeniedError, match="admin credential"):
                call()
    with client(target, other_token) as stranger:
        with pytest.raises(PermissionDeniedError):
            stranger.submit(mine, ones)
    with client(target, ADMIN) as admin:
        result = admin.finalize(mine)
    assert result.examples == 3
    np.testing.assert_array_equal(result.sums["w"], np.full(4, 3.0, np.float32))


@pytest.mark.parametrize("token", [None, "not-a-credential", ADMIN + "x", "cst1_" + "A" * 43])
def test_without_a_credential_only_health_and_reflection_answer(auth_server, token):
    target = target_of(auth_server)
    with client(target, ADMIN) as admin:
        aggregation = admin.create_aggregation(LAYERS)
    with client(target, token) as anonymous:
        for call in (lambda: anonymous.submit(aggregation, {"w": np.ones((1, 4), np.float32)}),
                     lambda: anonymous.get_aggregation(aggregation), anonymous.list_aggregations,
                     lambda: anonymous.finalize(aggregation), lambda: anonymous.cancel(aggregation),
                     lambda: anonymous.create_aggregation(LAYERS)):
            with pytest.raises(UnauthenticatedError):
                call()
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_a_submit_token_dies_with_its_aggregation(auth_server):
    target = target_of(auth_server)
    with client(target, ADMIN) as admin:
        admin.create_aggregation(LAYERS, aggregation_id="reused")
        old = admin.get_aggregation("reused").submit_token
        assert admin.get_aggregation("reused").submit_token == old  # the same every time it is described
        admin.cancel("reused")
        admin.create_aggregation(LAYERS, aggregation_id="reused")
        new = admin.get_aggregation("reused").submit_token
    assert new != old
    with client(target, old) as holder:
        with pytest.raises(UnauthenticatedError):  # no longer a credential of this server
            holder.submit("reused", {"w": np.ones((1, 4), np.float32)})


def test_submit_tokens_survive_a_restart(tmp_path):
    settings = Settings(**{**TEST_SETTINGS, "admin_token": ADMIN, "data_dir": str(tmp_path)})
    server, port = create_server(settings)
    try:
        with client(f"127.0.0.1:{port}", ADMIN) as admin:
            aggregation = admin.create_aggregation(LAYERS)
            token = admin.get_aggregation(aggregation).submit_token
    finally:
        server.stop(grace=1.0)
    assert (tmp_path / "submit-token.key").stat().st_mode & 0o777 == 0o600
    server, port = create_server(settings)
    try:
        with client(f"127.0.0.1:{port}", token) as participant:
            assert participant.submit(aggregation, {"w": np.ones((2, 4), np.float32)}).examples == 2
    finally:
        server.stop(grace=1.0)


def test_serve_refuses_to_listen_beyond_loopback_without_credentials():
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        with pytest.raises(ValueError, match="without credentials"):
            Settings(**{**TEST_SETTINGS, "host": host})
        assert Settings(**{**TEST_SETTINGS, "host": host, "admin_token": "t"}).host == host
        assert Settings(**{**TEST_SETTINGS, "host": host, "insecure": True}).insecure
    for host in ("127.0.0.1", "127.8.9.1", "::1", "localhost"):
        assert Settings(**{**TEST_SETTINGS, "host": host}).host == host
