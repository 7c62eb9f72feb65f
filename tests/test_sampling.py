"""Sampling the server draws (docs/privacy.md, "Sampling the server draws"), through a real server with auth on.

A ledger whose policy says ``Privacy(..., sampling="poisson", sampling_rate=q, drawn_by="server")`` takes each
release's clients from the server's keyed coin: the drawn rate is q within binomial bounds, a client not drawn
is refused before its bytes are read and moves nothing, asking again or re-presenting it changes nothing, the
draws survive a restart, and the secret shows nowhere.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import uuid

import grpc
import httpx
import numpy as np
import pytest
from conftest import ADMIN_TOKEN, TEST_SETTINGS

from clipd.client import Client, ClipdError, FailedPreconditionError, Privacy
from clipd.server.app import create_server
from clipd.server.settings import Settings
from clipd.v1 import clipd_pb2 as pb

LAYERS = {"w": (8,)}
RATE = 0.3


def drawn_policy(ledger: str | None = None, **more) -> Privacy:
    return Privacy(ledger or f"drawn-{uuid.uuid4().hex[:10]}", 1e-5, noise_multiplier=more.pop("z", 1.0),
                   sampling="poisson", sampling_rate=RATE, drawn_by="server", **more)


@pytest.fixture()
def admin(auth_server):
    with Client(f"127.0.0.1:{auth_server.port}", token=ADMIN_TOKEN) as client:
        yield client


def open_round(client: Client, privacy: Privacy) -> str:
    return client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=privacy, unit="client")


def test_the_drawn_rate_is_q_release_by_release_and_independent(admin):
    """10 releases x 10,000 candidates: 100,000 (client, release) draws at q = 0.3. The drawn count is within
    4.5 standard deviations of n q (a sound draw fails this about once in 150,000 runs); so is the overlap of
    two releases' draws (n q^2: independent across releases); asking again gives the same draws."""
    candidates = [f"c{i}" for i in range(10_000)]
    privacy = drawn_policy()
    rounds = []
    for release in range(1, 11):
        aggregation = open_round(admin, privacy)
        drawn = admin.draw_clients(aggregation, candidates)
        assert admin.draw_clients(aggregation, candidates) == drawn  # the same draw, every time it is asked
        chosen = set(drawn)
        assert drawn == [c for c in candidates if c in chosen]  # in the order given
        rounds.append(chosen)
        assert admin.finalize(aggregation).release.ledger_releases == release
        admin.cancel(aggregation)
    n = 10 * len(candidates)
    total = sum(len(r) for r in rounds)
    assert abs(total - n * RATE) <= 4.5 * math.sqrt(n * RATE * (1 - RATE))
    pairs = len(candidates) * 9
    both = sum(len(a & b) for a, b in zip(rounds, rounds[1:]))
    assert abs(both - pairs * RATE ** 2) <= 4.5 * math.sqrt(pairs * RATE ** 2 * (1 - RATE ** 2))


def test_a_client_not_drawn_is_refused_and_moves_nothing(admin):
    """z = 0 (the sum exact): a drawn client's update is summed; one not drawn is refused with
    FAILED_PRECONDITION "not drawn for this release", again when re-presented, and under the same id after the
    round is cancelled and opened again (the same release: the same draw); the release holds the drawn
    clients' updates only."""
    privacy = drawn_policy(z=0.0)
    aggregation = open_round(admin, privacy)
    candidates = [f"site-{i}" for i in range(40)]
    drawn = admin.draw_clients(aggregation, candidates)
    out = [c for c in candidates if c not in drawn]
    assert drawn and out
    update = {"w": np.full(8, 0.1, np.float32)}
    for _ in range(2):
        with pytest.raises(FailedPreconditionError, match="not drawn for this release") as e:
            admin.submit(aggregation, update, client_id=out[0])
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    admin.cancel(aggregation)
    aggregation = open_round(admin, privacy)
    assert admin.draw_clients(aggregation, candidates) == drawn
    with pytest.raises(FailedPreconditionError, match="not drawn"):
        admin.submit(aggregation, update, client_id=out[0])
    for client in drawn[:3]:
        admin.submit(aggregation, update, client_id=client)
    result = admin.finalize(aggregation)
    np.testing.assert_allclose(result.sums["w"], 0.3, rtol=1e-6)  # three clients' 0.1, none of the refused
    assert (result.release.sampling, result.release.sampling_rate, result.release.sampling_drawn_by) == (
        "poisson", RATE, "server")
    ledger = admin.ledger(privacy.ledger_id)
    assert ledger.sampling_drawn_by == "server" and len(ledger.entries) == 1
    assert '"sampling_probability": 0.3' in ledger.entries[0].dp_event_json  # accounted as Poisson at q


def test_a_server_drawn_ledger_releases_one_aggregation_at_a_time(admin):
    """Its draws are for its next release: a second open aggregation on it is refused until the first is
    released or cancelled; the caller's own draws can't share the ledger."""
    privacy = drawn_policy()
    first = open_round(admin, privacy)
    with pytest.raises(FailedPreconditionError, match="one aggregation at a time"):
        open_round(admin, privacy)
    admin.cancel(first)
    second = open_round(admin, privacy)
    admin.finalize(second)
    callers = Privacy(privacy.ledger_id, 1e-5, noise_multiplier=1.0, sampling="poisson", sampling_rate=RATE)
    with pytest.raises(FailedPreconditionError, match="drawn by the server, this aggregation's by the caller"):
        open_round(admin, callers)


def test_what_the_server_cannot_draw_is_refused(auth_server, server):
    """Example units, sampling other than Poisson, self-asserted ids and a server without credentials are
    refused (INVALID_ARGUMENT); DrawClients on an aggregation whose sampling the caller draws is
    FAILED_PRECONDITION, with too many candidates INVALID_ARGUMENT; a submit token may not ask."""
    with Client(f"127.0.0.1:{auth_server.port}", token=ADMIN_TOKEN) as admin:
        for words, create in [
            ("needs unit client", lambda: admin.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=drawn_policy())),
            ("must come from credentials", lambda: admin.create_aggregation(
                LAYERS, l2_norm_clip=1.0, privacy=drawn_policy(), unit="client", self_asserted_client_ids=True)),
            ("Poisson samples only", lambda: open_round(admin, Privacy(
                "x", 1e-5, noise_multiplier=1.0, drawn_by="server"))),
        ]:
            with pytest.raises(ClipdError, match=words) as e:
                create()
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        plain = open_round(admin, Privacy(f"p-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=1.0))
        with pytest.raises(FailedPreconditionError, match="not drawn by the server"):
            admin.draw_clients(plain, ["a"])
        drawn = open_round(admin, drawn_policy())
        with pytest.raises(ClipdError, match="at most 100000") as e:
            admin._call(admin._stub.DrawClients, pb.DrawClientsRequest(  # (the client splits longer lists)
                aggregation_id=drawn, client_ids=[f"c{i}" for i in range(100_001)]))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        token = admin.get_aggregation(drawn).submit_token
        with Client(f"127.0.0.1:{auth_server.port}", token=token) as submitter, pytest.raises(ClipdError) as e:
            submitter.draw_clients(drawn, ["a"])
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        admin.cancel(drawn)
    with Client(f"127.0.0.1:{server.port}") as anyone, pytest.raises(ClipdError, match="no admin token") as e:
        open_round(anyone, drawn_policy())
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_the_draws_survive_a_restart_and_the_secret_shows_nowhere(tmp_path, caplog):
    """A SQLite store: the draws after a restart are the draws before. The key the draws are made with (and
    the store's key it comes from), in hex and base64, appear in no response, no admin JSON, no metric and no
    log line."""
    caplog.set_level(logging.DEBUG)
    settings = Settings(**{**TEST_SETTINGS, "admin_port": 0, "admin_token": ADMIN_TOKEN,
                           "data_dir": str(tmp_path / "data")})
    candidates = [f"n{i}" for i in range(500)]
    privacy = drawn_policy()
    shown: list[bytes] = []
    server, _ = create_server(settings)
    try:
        with Client(f"127.0.0.1:{server.port}", token=ADMIN_TOKEN) as admin:
            aggregation = open_round(admin, privacy)
            before = admin.draw_clients(aggregation, candidates)
            admin.submit(aggregation, {"w": np.full(8, 0.1, np.float32)}, client_id=before[0])
            result = admin.finalize(aggregation)
            shown += [str(result.release).encode(), admin.ledger(privacy.ledger_id).SerializeToString()]
            aggregation = open_round(admin, privacy)
            second = admin.draw_clients(aggregation, candidates)
        store_key = server.store.submit_token_key()
    finally:
        server.stop(grace=1.0)
    server, _ = create_server(settings)
    try:
        with Client(f"127.0.0.1:{server.port}", token=ADMIN_TOKEN) as admin:
            assert admin.draw_clients(aggregation, candidates) == second  # the same release, the same draws
            assert second != before  # (release 2's draws are another coin)
            shown.append(admin.get_aggregation(aggregation).SerializeToString())
        base = f"http://127.0.0.1:{server.admin.port}"
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        for path in ("/api/v1/server", f"/api/v1/ledgers/{privacy.ledger_id}", "/api/v1/ledgers",
                     f"/api/v1/aggregations/{aggregation}", "/metrics"):
            answer = httpx.get(base + path, headers=headers)
            assert answer.status_code == 200, path
            shown.append(answer.content)
    finally:
        server.stop(grace=1.0)
    key = hmac.new(store_key, b"clipd-sampling-key/1", hashlib.sha256).digest()
    shown.append("\n".join(r.getMessage() for r in caplog.records).encode())
    for secret in (key, store_key):
        for form in (secret, secret.hex().encode(), base64.b64encode(secret), base64.urlsafe_b64encode(secret)):
            assert not any(form in text for text in shown)
    assert any(b"sampling_drawn_by" in text for text in shown)  # (the admin JSON says who drew)
