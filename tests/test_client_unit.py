"""The privacy unit and identities a client can't choose, through the real server (auth on, SQLite store).

Under ``unit="client"`` one client identity moves the sum by at most the clip bound, whatever it sends: its one
batch's rows summed and clipped once, any later batch refused, a resent one a duplicate. The expected sums are
float64 references computed here from the rows sent. The identity is its credential's: a client token (for an
aggregation or a ledger), a client certificate (tests/test_tls.py), or a trusted submitter's naming; every
other way in is refused with the documented status.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
from conftest import ADMIN_TOKEN as ADMIN
from conftest import TEST_SETTINGS

from clipd import cli, wire
from clipd.client import (
    AlreadyExistsError,
    Client,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    Privacy,
    UnauthenticatedError,
)
from clipd.server.app import create_server
from clipd.server.settings import Settings
from clipd.v1 import clipd_pb2 as pb

WIDTH = 70_000  # floats a row: 280 kB, so a batch of rows spans messages and a broken stream's part is kept
MESSAGE = 64 << 10  # bytes of tensor data a raw message carries
CLIP = 1.0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    server, port = create_server(Settings(**{**TEST_SETTINGS, "admin_token": ADMIN, "admin_port": 0,
                                             "data_dir": str(tmp_path_factory.mktemp("clipd-unit")),
                                             "stream_idle_timeout": 10.0}))
    yield server, f"127.0.0.1:{port}"
    server.stop(grace=1.0)


def _client(target: str, token: str | None) -> Client:
    return Client(target, token=token, retry_timeout=0.5, message_bytes=MESSAGE)


def _clipped(rows: np.ndarray, clip: float = CLIP) -> np.ndarray:
    """A client's contribution, in float64: its rows summed, then clipped to ``clip`` once."""
    total = rows.astype(np.float64).sum(axis=0)
    return total * min(1.0, clip / np.linalg.norm(total))


def _metadata(token: str | None):
    return ((wire.AUTHORIZATION_KEY, wire.BEARER + token),) if token else ()


def _hello(aggregation: str, client: str, writer: str, resume: bool = False) -> bytes:
    return wire.submit_request(aggregation, client, 0, [], writer, resume)


def _batch(aggregation: str, client: str, sequence: int, rows: np.ndarray, writer: str, start=None) -> list[bytes]:
    return [m for m, _ in wire.encode_batch(aggregation, client, sequence, [rows], MESSAGE, writer, start=start)]


class RawStream:
    """One Submit stream of raw messages: ``send`` queues them, ``responses`` is the server's side."""

    def __init__(self, target: str, token: str | None) -> None:
        self.channel = grpc.insecure_channel(target)
        self._queue: list = []
        self._cond = threading.Condition()
        submit = self.channel.stream_stream(wire.SUBMIT_METHOD, request_serializer=None, response_deserializer=None)
        self.call = submit(self._requests(), metadata=_metadata(token), timeout=60)

    def _requests(self):
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                message = self._queue.pop(0)
            if message is None:
                return
            yield message

    def send(self, *messages) -> None:
        with self._cond:
            self._queue.extend(messages)
            self._cond.notify_all()

    def next(self) -> pb.SubmitResponse:
        return pb.SubmitResponse.FromString(next(self.call))

    def until(self, done) -> pb.SubmitResponse:
        """Responses until one for which ``done(response)``."""
        while True:
            response = self.next()
            if done(response):
                return response

    def error(self) -> grpc.RpcError:
        """The status the stream ends with (it must end with one)."""
        with pytest.raises(grpc.RpcError) as e:
            while True:
                self.next()
        return e.value

    def close(self) -> None:
        self.send(None)
        self.channel.close()


def test_one_client_moves_the_sum_by_at_most_its_bound_through_batches_streams_and_a_resume(deployment):
    """alice (a client token) sends 10 examples in 3 batches over 4 streams: batch 1 (4 rows) is cut mid-way and
    taken up by a resuming stream, batches 2 and 3 are refused, a resent batch 1 is a duplicate, another name is
    refused. bob sends 10 examples through the Python client. The sum is each one's rows summed and clipped
    once: at most C each."""
    server, target = deployment
    rows = np.random.default_rng(37).normal(0.0, 0.05, (10, WIDTH)).astype(np.float32)  # each row's norm ~13
    bob_rows = np.random.default_rng(38).normal(0.0, 0.05, (10, WIDTH)).astype(np.float32)
    with _client(target, ADMIN) as admin:
        agg = admin.create_aggregation({"w": (WIDTH,)}, l2_norm_clip=CLIP, unit="client")
        described = admin.get_aggregation(agg)
        assert (described.unit, described.client_ids) == (pb.CLIENT, "credential")
        alice, bob = admin.client_token("alice", aggregation=agg), admin.client_token("bob", aggregation=agg)

    first = _batch(agg, "", 1, rows[:4], "w1")
    half = len(first) // 2
    cut = RawStream(target, alice)
    cut.send(_hello(agg, "", "w1"), *first[:half])
    assert cut.next().client_id == "alice"  # counted under its token's client id (it named none)
    sent = sum(len(m) for m in first[:half])
    cut.until(lambda r: r.received_bytes >= sent - half * 256)  # the server has what was sent: the cut
    cut.call.cancel()
    cut.close()

    resumed = RawStream(target, alice)
    resumed.send(_hello(agg, "alice", "w1", resume=True))
    greeting = resumed.next()
    assert greeting.partial_sequence == 1 and greeting.partial_bytes[0] > 0  # the first half was kept
    resumed.send(*_batch(agg, "alice", 1, rows[:4], "w1", start=list(greeting.partial_bytes)))
    resumed.until(lambda r: r.acknowledged_sequence == 1)
    resumed.send(*_batch(agg, "alice", 2, rows[4:7], "w1"))  # a second batch of the same client
    refused = resumed.error()
    assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "contributes one batch (sequence 1)" in refused.details() and "batch 2 is refused" in refused.details()
    resumed.close()

    again = RawStream(target, alice)  # a second submission, after the acknowledgement
    again.send(_hello(agg, "alice", "w2"))
    assert (again.next().accepted_sequence, 1) == (1, 1)
    again.send(*_batch(agg, "alice", 2, rows[7:], "w2"))
    assert again.error().code() is grpc.StatusCode.FAILED_PRECONDITION
    again.close()

    resend = RawStream(target, alice)  # a reconnect that re-sends batch 1 whole: a duplicate
    resend.send(_hello(agg, "alice", "w3"), *first)
    assert resend.until(lambda r: r.acknowledged_sequence == 1).aggregation_examples == 1
    resend.send(None)
    resend.channel.close()

    renamed = RawStream(target, alice)
    renamed.send(_hello(agg, "alice-1", "w4"))
    denied = renamed.error()
    assert denied.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "this client token is for client 'alice'; it may not submit as 'alice-1'" in denied.details()
    renamed.close()

    with _client(target, bob) as participant:
        report = participant.submit(agg, {"w": bob_rows})  # summed by the client, sent as one row
        assert (report.client_id, report.batches, report.examples) == ("bob", 1, 1)
        with pytest.raises(FailedPreconditionError, match="'bob' contributes one batch"):
            participant.submit(agg, {"w": bob_rows[:1]})
    with _client(target, ADMIN) as admin:
        result = admin.finalize(agg)
    assert result.examples == 2  # two contributions: one a client
    expected = _clipped(rows[:4]) + _clipped(bob_rows)
    np.testing.assert_allclose(result.sums["w"], expected, rtol=1e-5, atol=1e-7)
    assert np.linalg.norm(result.sums["w"]) <= 2 * CLIP * (1 + 1e-6)
    assert result.clip_counts["w"] == 2


def _forged(token: str, client_id: str) -> str:
    """``token`` with another client id in its fields and its old signature."""
    payload, _, mac = token[len("cct1_"):].partition(".")
    fields = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    fields["client_id"] = client_id
    forged = base64.urlsafe_b64encode(json.dumps(fields).encode()).rstrip(b"=").decode()
    return f"cct1_{forged}.{mac}"


def test_on_a_client_ledger_every_way_around_the_bound_is_refused_or_bounded(deployment):
    """A private ledger at z = 0, unit client: many examples, a second submission, another name, no token, a token
    for another aggregation or ledger, a forged or expired one, the submit token naming a client, a re-sent batch:
    each refused with its status or bounded by C; the release is the clipped contributions, exactly."""
    server, target = deployment
    ledger, other_ledger = f"unit-{uuid.uuid4().hex[:8]}", f"unit-{uuid.uuid4().hex[:8]}"
    privacy = Privacy(ledger_id=ledger, delta=1e-5, noise_multiplier=0.0)
    rng = np.random.default_rng(7)
    many = rng.normal(0.0, 1.0, (50, 6)).astype(np.float32) + 1.0  # 50 examples, norms ~3
    bob_update = np.full((1, 6), 0.1, np.float32)  # within the bound: not clipped
    with _client(target, ADMIN) as admin:
        agg = admin.create_aggregation({"w": (6,)}, l2_norm_clip=CLIP, privacy=privacy, unit="client")
        elsewhere = admin.create_aggregation({"w": (6,)}, l2_norm_clip=CLIP, unit="client")
        alice = admin.client_token("alice", ledger=ledger)
        bob = admin.client_token("bob", ledger=ledger)
        for_elsewhere = admin.client_token("alice", aggregation=elsewhere)
        for_other_ledger = admin.client_token("alice", ledger=other_ledger)
        expiring = admin.client_token("carol", ledger=ledger, ttl=0.05)
        submit_token = admin.get_aggregation(agg).submit_token
        with pytest.raises(FailedPreconditionError, match=rf"ledger '{ledger}' exists with another configuration:"
                                                          r" its unit is 'client'.*a ledger accounts one unit"):
            admin.create_aggregation({"w": (6,)}, l2_norm_clip=CLIP, privacy=privacy)  # an example-unit one
    with _client(target, alice) as participant:
        assert participant.submit(agg, {"w": many}).examples == 1
        with pytest.raises(FailedPreconditionError, match="batch 2 is refused"):
            participant.submit(agg, {"w": many[:1]})
        with pytest.raises(PermissionDeniedError, match="may not submit as 'mallory'"):
            participant.submit(agg, {"w": many[:1]}, client_id="mallory")
    refusals = [
        (None, "alice", UnauthenticatedError, "a valid 'authorization: Bearer <token>' is required"),
        (for_elsewhere, None, PermissionDeniedError, f"may not (read|submit to) aggregation '{agg}'"),
        (for_other_ledger, None, PermissionDeniedError, f"may not (read|submit to) aggregation '{agg}'"),
        (_forged(alice, "mallory"), None, UnauthenticatedError, "a valid 'authorization"),
        (submit_token, "mallory", PermissionDeniedError, "counts client identities .*its unit is client.*client"
                                                         " token"),
    ]
    time.sleep(0.06)
    refusals.append((expiring, None, UnauthenticatedError, "this client token expired at"))
    for token, name, error, message in refusals:
        with _client(target, token) as participant, pytest.raises(error, match=message):
            participant.submit(agg, {"w": many[:3]}, client_id=name)
    resend = RawStream(target, alice)  # a reconnect that re-sends the first batch: nothing counted twice
    resend.send(_hello(agg, "alice", "again"), *_batch(agg, "alice", 1, many, "again"))
    resend.until(lambda r: r.acknowledged_sequence == 1)
    resend.close()
    with _client(target, bob) as participant:
        participant.submit(agg, {"w": bob_update})
    with _client(target, ADMIN) as admin:
        result = admin.finalize(agg)
        ledger_view = admin.ledger(ledger)
        admin.cancel(elsewhere)
    expected = _clipped(many) + bob_update[0].astype(np.float64)
    np.testing.assert_allclose(result.sums["w"], expected, rtol=1e-6)
    assert np.linalg.norm(_clipped(many)) == pytest.approx(CLIP)  # alice moved it by C, for 50 examples
    release = result.release
    assert (release.unit, release.client_ids, release.noise_stddev) == (pb.CLIENT, "credential", 0.0)
    assert (ledger_view.unit, ledger_view.client_ids) == (pb.CLIENT, "credential")


def test_a_refused_client_cannot_come_back_under_another_name(deployment):
    """A correlated ledger (BLT, 6 releases, b = 2, k = 3) whose participation the server enforces: alice (a ledger
    token) takes part in release 0 and is refused in release 1; her token naming alice-1, no token, a token of
    another aggregation for alice-1 and the aggregation's submit token naming alice-1 are all refused; alice-1's
    own credential, issued by the admin, is another client (the admin made it)."""
    server, target = deployment
    ledger = f"blt-{uuid.uuid4().hex[:8]}"
    privacy = Privacy(ledger_id=ledger, delta=1e-5, noise_multiplier=1.0, accountant="pld", seed=1, mechanism="blt",
                      releases=6, min_separation=2, max_participations=3, buffers=2)
    update = {"w": np.full(6, 0.1, np.float32)}
    with _client(target, ADMIN) as admin:
        alice = admin.client_token("alice", ledger=ledger)
        round0 = admin.create_aggregation({"w": (6,)}, l2_norm_clip=CLIP, privacy=privacy, unit="client")
        with _client(target, alice) as participant:
            participant.submit(round0, update)
        assert admin.finalize(round0).release.stream_release == 0
        round1 = admin.create_aggregation({"w": (6,)}, l2_norm_clip=CLIP, privacy=privacy, unit="client")
        other = admin.create_aggregation({"w": (6,)}, l2_norm_clip=CLIP)
        other_token = admin.client_token("alice-1", aggregation=other)
        submit_token = admin.get_aggregation(round1).submit_token
        for token, name, error, message in [
            (alice, None, FailedPreconditionError, "client 'alice' took part in release 0"),
            (alice, "alice-1", PermissionDeniedError, "it may not submit as 'alice-1'"),
            (None, "alice-1", UnauthenticatedError, "Bearer"),
            (other_token, None, PermissionDeniedError, f"may not (read|submit to) aggregation '{round1}'"),
            (submit_token, "alice-1", PermissionDeniedError, "its ledger's correlated noise stream limits each"
                                                             " client's participation"),
        ]:
            with _client(target, token) as participant, pytest.raises(error, match=message):
                participant.submit(round1, update, client_id=name)
        with pytest.raises(FailedPreconditionError, match="client ids are 'credential'.*'self_asserted'"):
            admin.create_aggregation({"w": (6,)}, l2_norm_clip=CLIP, privacy=privacy, unit="client",
                                     self_asserted_client_ids=True)
        result = admin.finalize(round1)  # nobody took part: the noise alone
        assert (result.release.stream_release, result.release.client_ids) == (1, "credential")
        admin.cancel(other)


def test_self_asserted_client_ids_are_an_opt_in_recorded_on_the_ledger_and_every_release(deployment):
    server, target = deployment
    ledger = f"asserted-{uuid.uuid4().hex[:8]}"
    privacy = Privacy(ledger_id=ledger, delta=1e-5, noise_multiplier=0.0)
    with _client(target, ADMIN) as admin:
        agg = admin.create_aggregation({"w": (3,)}, l2_norm_clip=CLIP, privacy=privacy, unit="client",
                                       self_asserted_client_ids=True)
        assert admin.get_aggregation(agg).client_ids == "self_asserted"
        submit_token = admin.get_aggregation(agg).submit_token
        with _client(target, submit_token) as participant:
            participant.submit(agg, {"w": np.ones((2, 3), np.float32)}, client_id="anyone")
            participant.submit(agg, {"w": np.ones((1, 3), np.float32)}, client_id="anyone-else")
        result = admin.finalize(agg)
        assert (result.release.unit, result.release.client_ids) == (pb.CLIENT, "self_asserted")
        assert admin.ledger(ledger).client_ids == "self_asserted"
        view = json.loads(_admin_get(server, f"/api/v1/aggregations/{agg}"))
        assert (view["unit"], view["client_ids"], view["privacy"]["release"]["client_ids"]) == (
            "client", "self_asserted", "self_asserted")
        assert json.loads(_admin_get(server, f"/api/v1/ledgers/{ledger}"))["client_ids"] == "self_asserted"
    # 2 + 1 examples, each client's sum clipped to 1: sqrt(3)... of (2, 2, 2) and (1, 1, 1)
    np.testing.assert_allclose(result.sums["w"], np.full(3, 2 / np.sqrt(3), np.float32), rtol=1e-6)


def _admin_get(server, path: str) -> str:
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{server.admin.port}{path}",
                                     headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode()


def test_bad_units_and_token_requests_are_refused_with_what_to_do(deployment):
    server, target = deployment
    channel = grpc.insecure_channel(target)
    create = channel.unary_unary("/clipd.v1.Clipd/CreateAggregation",
                                 request_serializer=pb.CreateAggregationRequest.SerializeToString,
                                 response_deserializer=pb.Aggregation.FromString)
    request = pb.CreateAggregationRequest(layers=[pb.LayerSpec(name="w", shape=[3], dtype=pb.FLOAT32)],
                                          policy=pb.ClipPolicy(kind=pb.ClipPolicy.GLOBAL, l2_norm_clip=1.0), unit=7)
    with pytest.raises(grpc.RpcError) as e:
        create(request, metadata=_metadata(ADMIN), timeout=10)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "unit: unknown value 7" in e.value.details()
    channel.close()
    with _client(target, ADMIN) as admin:
        with pytest.raises(ValueError, match="unit must be one of"):
            admin.create_aggregation({"w": (3,)}, unit="household")
        agg = admin.create_aggregation({"w": (3,)}, l2_norm_clip=CLIP, unit="client")
        assert admin.create_aggregation({"w": (3,)}, l2_norm_clip=CLIP, unit="client", aggregation_id=agg) == agg
        with pytest.raises(AlreadyExistsError, match="exists with another spec"):  # the same, but per example
            admin.create_aggregation({"w": (3,)}, l2_norm_clip=CLIP, aggregation_id=agg)
        for call, error, message in [
            (lambda: admin.client_token("alice", aggregation="no-such"), NotFoundError, "no aggregation 'no-such'"),
            (lambda: admin.client_token("alice~1", aggregation=agg), InvalidArgumentError, "client_id: 1-128"),
            (lambda: admin.client_token("alice", ledger="bad ledger"), InvalidArgumentError, "ledger_id"),
            (lambda: admin.client_token("alice", aggregation=agg, ttl=-1), InvalidArgumentError, "ttl_seconds"),
        ]:
            with pytest.raises(error, match=message):
                call()
        with pytest.raises(InvalidArgumentError, match="not spread over streams"):
            admin.submit(agg, {"w": np.ones((1, 3), np.float32)}, client_id="site~1")  # a trusted submitter
        admin.submit(agg, {"w": np.ones((1, 3), np.float32)}, client_id="site")  # nothing lost by the refusals
        token = admin.client_token("alice", aggregation=agg)
    with _client(target, token) as participant:
        with pytest.raises(PermissionDeniedError, match="needs the admin credential"):
            participant.client_token("alice", aggregation=agg)
        with pytest.raises(PermissionDeniedError, match="needs the admin credential"):
            participant.finalize(agg)
        assert [tuple(layer.shape) for layer in participant.get_aggregation(agg).layers] == [(3,)]
    with _client(target, ADMIN) as admin:
        result = admin.finalize(agg)
    assert result.examples == 1
    np.testing.assert_allclose(result.sums["w"], np.full(3, 1 / np.sqrt(3)), rtol=1e-6)


def test_clipd_token_prints_a_client_token_that_submits_as_its_client(deployment, capsys):
    server, target = deployment
    with _client(target, ADMIN) as admin:
        agg = admin.create_aggregation({"w": (3,)}, l2_norm_clip=CLIP, unit="client")
    assert cli.main(["token", "--target", target, "--token", ADMIN, "--aggregation", agg, "--client", "site-9"]) == 0
    token = capsys.readouterr().out.strip()
    with _client(target, token) as participant:
        assert participant.submit(agg, {"w": np.ones((1, 3), np.float32)}).client_id == "site-9"
    assert cli.main(["token", "--target", target, "--token", "wrong", "--aggregation", agg, "--client", "x"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli.main(["token", "--target", target, "--token", ADMIN, "--aggregation", agg, "--submitter"]) == 0
    submitter = capsys.readouterr().out.strip()
    with _client(target, submitter) as framework:
        assert framework.submit(agg, {"w": np.ones((1, 3), np.float32)}, client_id="node-4").client_id == "node-4"
    with _client(target, ADMIN) as admin:
        assert admin.finalize(agg).examples == 2


def test_per_layer_bounds_and_released_counts_follow_the_client_unit(deployment):
    """Per-layer uniform bounds clip each client's summed update layer by layer (C / sqrt(2) each), and the
    released statistics count clients: 3 clients of 5, 1 and 7 examples are 3 contributions."""
    server, target = deployment
    rng = np.random.default_rng(11)
    clients = {name: {"a": rng.normal(0, 1, (n, 4)).astype(np.float32), "b": rng.normal(0, 1, (n, 2)).astype(np.float32)}
               for name, n in (("x", 5), ("y", 1), ("z", 7))}
    privacy = Privacy(ledger_id=f"layers-{uuid.uuid4().hex[:8]}", delta=1e-5, noise_multiplier=0.0,
                      metrics_noise_multiplier=1e-9)
    with _client(target, ADMIN) as admin:
        agg = admin.create_aggregation({"a": (4,), "b": (2,)}, policy="per_layer_uniform", l2_norm_clip=CLIP,
                                       privacy=privacy, unit="client")
        for name, update in clients.items():
            admin.submit(agg, update, client_id=name)  # the admin: a trusted submitter
        release = admin.finalize(agg)
    bound = CLIP / np.sqrt(2)
    for layer in ("a", "b"):
        expected = sum(_clipped(update[layer], bound) for update in clients.values())
        np.testing.assert_allclose(release.sums[layer], expected, rtol=1e-5)
    assert release.release.examples == pytest.approx(3, abs=1e-6)  # clients, not the 13 examples


def test_adaptive_clipping_tracks_the_quantile_of_client_norms(deployment):
    """Adaptive clipping under unit client counts clients: of 3 clients (13 examples), 2 whose summed update is
    within C = 1, so b = (2 - 3/2) / 3 + 1/2 = 2/3 and C' = exp(-0.2 (2/3 - 1/2)) = 0.967216 (worked by hand; at
    z = 0 nothing is noised)."""
    server, target = deployment
    from clipd.client import Adaptive

    privacy = Privacy(ledger_id=f"adaptive-{uuid.uuid4().hex[:8]}", delta=1e-5, noise_multiplier=0.0,
                      public_denominator=3.0, adaptive=Adaptive(target_unclipped_quantile=0.5, learning_rate=0.2,
                                                                initial_bound=1.0))
    updates = {"x": np.full((5, 4), 0.05, np.float32),  # sum (0.25, ...): norm 0.5, within the bound
               "y": np.array([[0.3, 0.0, 0.0, 0.0]], np.float32),  # norm 0.3
               "z": np.full((7, 4), 3 / 14, np.float32)}  # sum (1.5, ...): norm 3, clipped
    with _client(target, ADMIN) as admin:
        agg = admin.create_aggregation({"w": (4,)}, l2_norm_clip=1.0, privacy=privacy, unit="client")
        for name, rows in updates.items():
            admin.submit(agg, {"w": rows}, client_id=name)
        release = admin.finalize(agg).release
    assert release.unclipped_fraction == pytest.approx(2 / 3, rel=1e-9)
    assert release.next_bound == pytest.approx(0.967216, abs=1e-6)
