"""Buffered streams (FedBuff; docs/streams.md) through a real server with auth on and a durable store: releases
every K contributions, staleness weights, exactly once across buffers, participation limits, releases as they
happen, bad input, and a restart. References are computed here with numpy from what was acknowledged."""

from __future__ import annotations

import concurrent.futures
import uuid

import grpc
import numpy as np
import pytest
from conftest import ADMIN_TOKEN, TEST_SETTINGS
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant

from clipd.client import Buffer, Client, ClipdError, FailedPreconditionError, InvalidArgumentError, Privacy
from clipd.server import streams as streams_module
from clipd.server.app import create_server
from clipd.server.settings import Settings

WIDTH = 64
CLIP = 1.0


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("streams")


@pytest.fixture(scope="module")
def server(data_dir):
    server, _ = create_server(Settings(**{**TEST_SETTINGS, "admin_token": ADMIN_TOKEN, "data_dir": str(data_dir)}))
    yield server
    server.stop(grace=1.0)


@pytest.fixture()
def admin(server):
    with Client(f"127.0.0.1:{server.port}", token=ADMIN_TOKEN) as client:
        yield client


def privacy(z: float = 0.0, k: int = 100, b: int = 1, **more) -> Privacy:
    return Privacy(f"stream-{uuid.uuid4().hex[:10]}", 1e-5, noise_multiplier=z, max_participations=k,
                   min_separation=b, **more)


def stream(admin, size: int, exponent: float = 0.5, max_staleness: int = 10, **more) -> str:
    return admin.create_stream({"w": (WIDTH,)}, l2_norm_clip=CLIP, privacy=privacy(**more),
                               buffer=Buffer(size=size, staleness_exponent=exponent, max_staleness=max_staleness))


def update(client: int, sequence: int, norm: float = 0.5) -> np.ndarray:
    """A contribution that can be told apart in a sum: its client's coordinate and its sequence's carry it."""
    x = np.zeros(WIDTH, np.float32)
    x[client % WIDTH] = norm * 0.6
    x[(client * 7 + sequence * 13) % WIDTH] += norm * 0.8
    return x


def released(admin, sid: str, version: int):
    """Waits for the stream's release of ``version`` (a buffer goes out once its K-th contribution is in)."""
    return next(admin.watch_releases(sid, after=version - 1, timeout=30))


def clipped(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x * min(1.0, CLIP / np.linalg.norm(x))


def test_each_release_is_the_weighted_sum_of_exactly_what_was_acknowledged_into_it(admin):
    """K = 3, z = 0: version 1 is three fresh contributions (weight 1); version 2 holds contributions trained from
    version 0 (1 stale: weight 2^-0.5) and from version 1 (fresh), one of norm 3 (clipped to 1 first, then
    weighted); each release says its contributions and their staleness, and equals the float64 reference."""
    sid = stream(admin, 3)
    expected = np.zeros(WIDTH)
    for i in range(3):
        x = update(i, 1)
        ack = admin.submit_to_stream(sid, {"w": x}, trained_from=0, client_id=f"c{i}")
        assert (ack.version, ack.staleness, ack.weight, ack.duplicate) == (1, 0, 1.0, False)
        expected += clipped(x)
    first = next(admin.watch_releases(sid, after=0, timeout=30))
    assert first.version == 1 and first.release.contributions == 3 and list(first.release.staleness) == [0, 0, 0]
    np.testing.assert_allclose(first.sums["w"], expected, rtol=1e-6, atol=1e-7)
    expected = np.zeros(WIDTH)
    for i, (trained, norm) in enumerate([(0, 0.5), (1, 3.0), (0, 0.5)]):
        x = update(i, 2, norm)
        ack = admin.submit_to_stream(sid, {"w": x}, trained_from=trained, client_id=f"c{i}")
        tau = 1 - trained
        assert (ack.version, ack.staleness) == (2, tau) and ack.weight == pytest.approx((1 + tau) ** -0.5)
        expected += (1 + tau) ** -0.5 * clipped(x)
    second = next(admin.watch_releases(sid, after=1, timeout=30))
    assert admin.stream_release(sid, 2).release == second.release
    assert list(second.release.staleness) == [0, 1, 1] and second.release.stream_id == sid
    np.testing.assert_allclose(second.sums["w"], expected, rtol=1e-6, atol=1e-7)
    assert admin.stream(sid).version == 2


def test_a_resend_counts_once_and_says_where_it_counts(admin):
    """A contribution resent after its buffer was released is a duplicate: acknowledged with its version, not
    counted again; a sequence out of order is refused; the client's standing says its next sequence."""
    sid = stream(admin, 2)
    x = {"w": update(1, 1)}
    first = admin.submit_to_stream(sid, x, trained_from=0, client_id="a", sequence=1)
    admin.submit_to_stream(sid, {"w": update(2, 1)}, trained_from=0, client_id="b", sequence=1)
    one = released(admin, sid, 1)
    again = admin.submit_to_stream(sid, x, trained_from=0, client_id="a", sequence=1)
    assert again.duplicate and again.version == first.version == 1
    with pytest.raises(FailedPreconditionError, match="its next is sequence 2, not 5"):
        admin.submit_to_stream(sid, x, trained_from=1, client_id="a", sequence=5)
    standing = admin.stream_client(sid, "a")
    assert (standing.contributions, standing.next_sequence, list(standing.versions)) == (1, 2, [1])
    admin.submit_to_stream(sid, {"w": update(3, 1)}, trained_from=1, client_id="c", sequence=1)
    admin.submit_to_stream(sid, {"w": update(1, 2)}, trained_from=1, client_id="a", sequence=2)
    second = next(admin.watch_releases(sid, after=1, timeout=30))
    assert second.release.contributions == 2  # the duplicate counted in neither
    np.testing.assert_allclose(one.sums["w"], clipped(update(1, 1)) + clipped(update(2, 1)), rtol=1e-6,
                               atol=1e-7)


def test_stale_future_and_bad_contributions_are_refused_and_move_nothing(admin):
    """Past max_staleness: FAILED_PRECONDITION naming the newest version; a version not released yet:
    INVALID_ARGUMENT; a batch of several rows: INVALID_ARGUMENT; an unknown stream: NOT_FOUND. The buffer's
    fill does not move."""
    sid = stream(admin, 2, max_staleness=1)
    for version in range(1, 4):
        for i in range(2):
            admin.submit_to_stream(sid, {"w": update(i, version)}, trained_from=version - 1, client_id=f"s{i}")
        released(admin, sid, version)
    assert admin.stream(sid).version == 3
    with pytest.raises(FailedPreconditionError, match="2 versions stale .* newest version, 3"):
        admin.submit_to_stream(sid, {"w": update(5, 1)}, trained_from=1, client_id="late")
    with pytest.raises(InvalidArgumentError, match="newest version is 3"):
        admin.submit_to_stream(sid, {"w": update(5, 1)}, trained_from=4, client_id="early")
    with pytest.raises(ClipdError) as e:
        admin.submit_to_stream("no-such-stream", {"w": update(5, 1)}, trained_from=0, client_id="x")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert admin.stream(sid).filling == 0 and admin.stream_client(sid, "late").contributions == 0


@pytest.mark.parametrize("in_memory", [1 << 20, 1])
def test_participation_limits_hold_across_buffers(admin, monkeypatch, in_memory):
    """k = 2, b = 3, K = 1: alice, in version 1, is refused while version 4 is beyond the next buffer (b), goes
    into version 4 once it is the next buffer (not refused: taken ahead), and is refused from then on (k); the
    ledger's epsilon is dp_accounting's for min(k, ceil(n / b)) Gaussians. The same when the stream keeps one
    client's versions in memory (the others' from the store)."""
    monkeypatch.setattr(streams_module, "PARTICIPANTS_IN_MEMORY", in_memory)
    sid = admin.create_stream({"w": (WIDTH,)}, l2_norm_clip=CLIP, privacy=(p := privacy(z=2.0, k=2, b=3)),
                              buffer=Buffer(size=1))
    assert admin.submit_to_stream(sid, {"w": update(0, 1)}, trained_from=0, client_id="alice").version == 1
    released(admin, sid, 1)
    with pytest.raises(FailedPreconditionError, match="it may take part again from version 4"):
        admin.submit_to_stream(sid, {"w": update(0, 2)}, trained_from=1, client_id="alice")
    admin.submit_to_stream(sid, {"w": update(1, 1)}, trained_from=1, client_id="bob")
    released(admin, sid, 2)
    ahead = admin.submit_to_stream(sid, {"w": update(0, 2)}, trained_from=2, client_id="alice")
    assert (ahead.version, ahead.staleness) == (4, 1)
    admin.submit_to_stream(sid, {"w": update(2, 1)}, trained_from=2, client_id="carol")
    released(admin, sid, 4)
    with pytest.raises(FailedPreconditionError, match="allows at most 2"):
        admin.submit_to_stream(sid, {"w": update(0, 3)}, trained_from=4, client_id="alice")
    assert admin.stream_client(sid, "alice").may_contribute_from == 0
    ledger = admin.ledger(p.ledger_id)
    most = len([t for t in range(0, 4, 3)][:2])
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dpe.GaussianDpEvent(2.0), most)
    assert len(ledger.entries) == 4 and ledger.epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


def test_the_budget_ends_a_stream_after_the_last_version_it_allows(admin):
    """z = 2, K = 1, a budget between dp_accounting's epsilon for 2 and for 3 Gaussians (k = 100, b = 1): the
    ledger refuses version 3, version 2 still fills and is released, then the stream stops; a contribution for
    version 3 is refused saying why, and the ledger holds 2 entries."""
    def epsilon(n):
        accountant = rdp_privacy_accountant.RdpAccountant()
        accountant.compose(dpe.GaussianDpEvent(2.0), n)
        return accountant.get_epsilon(1e-5)

    budget = (epsilon(2) + epsilon(3)) / 2
    sid = admin.create_stream({"w": (WIDTH,)}, l2_norm_clip=CLIP, privacy=(p := privacy(z=2.0, max_epsilon=budget)),
                              buffer=Buffer(size=1))
    assert admin.submit_to_stream(sid, {"w": update(0, 1)}, trained_from=0, client_id="c0").version == 1
    assert admin.submit_to_stream(sid, {"w": update(1, 1)}, trained_from=0, client_id="c1").version == 2
    with pytest.raises(FailedPreconditionError, match="(ends with version 2|version 2 was its last).*privacy budget"):
        admin.submit_to_stream(sid, {"w": update(2, 1)}, trained_from=0, client_id="c2")
    assert released(admin, sid, 2).version == 2
    view = admin.stream(sid)
    assert (view.version, view.state) == (2, "stopped") and "version 2 was its last" in view.reason
    ledger = admin.ledger(p.ledger_id)
    assert len(ledger.entries) == 2 and ledger.epsilon == pytest.approx(epsilon(2), rel=1e-9)


def test_twenty_clients_as_fast_as_they_can_are_each_counted_exactly_once(server, admin):
    """20 clients, 25 contributions each, K = 10 (a buffer that has waited 0.5 s is released as it is), z = 0:
    every acknowledged contribution is in exactly one release (each release equals the sum of the contributions
    acknowledged into it, told apart by their coordinates), no client saw a refusal, versions 1 to N with no
    gap, about 50 of them."""
    sid = admin.create_stream({"w": (WIDTH,)}, l2_norm_clip=CLIP, privacy=privacy(),
                              buffer=Buffer(size=10, staleness_exponent=0.0, max_staleness=1000, max_wait=0.5))
    acked: dict[int, list[tuple[int, int]]] = {}

    def client(i: int) -> list[tuple[int, int, int]]:
        with Client(f"127.0.0.1:{server.port}", token=ADMIN_TOKEN) as c:
            out = []
            for n in range(1, 26):
                ack = c.submit_to_stream(sid, {"w": update(i, n)}, trained_from=c.stream(sid).version,
                                         client_id=f"fast-{i}")
                out.append((i, n, ack.version))
            return out

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        for done in pool.map(client, range(20)):
            for i, n, version in done:
                acked.setdefault(version, []).append((i, n))
    last = max(acked)
    assert sorted(acked) == list(range(1, last + 1)) and 50 <= last <= 60
    releases = [release for _, release in zip(range(last), admin.watch_releases(sid, after=0, timeout=60))]
    assert [r.version for r in releases] == list(range(1, last + 1))
    for release in releases:
        expected = sum(clipped(update(i, n)) for i, n in acked[release.version])
        assert release.release.contributions == len(acked[release.version])
        np.testing.assert_allclose(release.sums["w"], expected, rtol=1e-5, atol=1e-6)
    assert sum(len(v) for v in acked.values()) == 500


def test_what_a_stream_cant_be_is_refused_plainly(admin):
    """No participation limits, a buffer of 0, a negative staleness exponent: INVALID_ARGUMENT;
    the same id with another spec: ALREADY_EXISTS; a buffer's own Submit, Finalize, cancel or draw:
    FAILED_PRECONDITION."""
    layers = {"w": (WIDTH,)}
    for words, make in [
        ("needs participation limits", lambda: admin.create_stream(
            layers, privacy=Privacy(f"p-{uuid.uuid4().hex[:6]}", 1e-5, noise_multiplier=1.0), buffer=Buffer(2))),
        ("at least 1 contribution", lambda: admin.create_stream(layers, privacy=privacy(), buffer=Buffer(0))),
        ("staleness_exponent", lambda: admin.create_stream(layers, privacy=privacy(),
                                                            buffer=Buffer(2, staleness_exponent=-0.5))),
    ]:
        with pytest.raises(ClipdError, match=words) as e:
            make()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    sid = admin.create_stream(layers, privacy=(p := privacy()), buffer=Buffer(2), stream_id="fixed-id-stream")
    assert admin.create_stream(layers, privacy=p, buffer=Buffer(2), stream_id="fixed-id-stream") == sid
    with pytest.raises(ClipdError) as e:
        admin.create_stream(layers, privacy=p, buffer=Buffer(3), stream_id="fixed-id-stream")
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    # Its buffers are the stream's: no Submit, Finalize, cancel or draw of their own (the stream goes on).
    buffer = f"{sid}.v1"
    for act in (lambda: admin.submit(buffer, {"w": np.zeros((1, WIDTH), np.float32)}, client_id="x"),
                lambda: admin.finalize(buffer), lambda: admin.cancel(buffer),
                lambda: admin.draw_clients(buffer, ["x"])):
        with pytest.raises(FailedPreconditionError, match="buffer of version 1 of stream .* go through SubmitToStream"):
            act()
    assert admin.stream(sid).state == "open" and admin.submit_to_stream(sid, {"w": update(0, 1)}, trained_from=0,
                                                                          client_id="x").version == 1


def test_a_stream_goes_on_after_a_restart(tmp_path):
    """A durable store: a buffer half full before a stop fills on after the restart; the versions go on from
    where they were, and duplicates are still recognized."""
    settings = Settings(**{**TEST_SETTINGS, "admin_token": ADMIN_TOKEN, "data_dir": str(tmp_path / "d")})
    server, _ = create_server(settings)
    try:
        with Client(f"127.0.0.1:{server.port}", token=ADMIN_TOKEN) as c:
            sid = stream(c, 2)
            for i in range(3):
                c.submit_to_stream(sid, {"w": update(i, 1)}, trained_from=0, client_id=f"r{i}")
            released(c, sid, 1)
    finally:
        server.stop(grace=1.0)
    server, _ = create_server(settings)
    try:
        with Client(f"127.0.0.1:{server.port}", token=ADMIN_TOKEN) as c:
            assert c.submit_to_stream(sid, {"w": update(0, 1)}, trained_from=0, client_id="r0", sequence=1).duplicate
            assert c.submit_to_stream(sid, {"w": update(2, 1)}, trained_from=0, client_id="r2", sequence=1).duplicate
            c.submit_to_stream(sid, {"w": update(3, 1)}, trained_from=1, client_id="r3")
            release = next(c.watch_releases(sid, after=1, timeout=30))
    finally:
        server.stop(grace=1.0)
    assert release.release.contributions == 2 and sorted(release.release.staleness) == [0, 1]
    np.testing.assert_allclose(release.sums["w"], 2 ** -0.5 * clipped(update(2, 1)) + clipped(update(3, 1)),
                               rtol=1e-6, atol=1e-7)


def test_the_admin_api_metrics_and_status_show_a_stream(tmp_path, capsys):
    """GET /api/v1/streams and /api/v1/streams/{id} (401 without the token, 404 for another id): the newest
    version, the open buffer's fill, the limits, contributions by staleness and the ledger's epsilon; /metrics
    the same as clipd_buffered_stream_* series; ``clipd status`` a row for it, and a stopped stream's reason."""
    import json
    import urllib.error
    import urllib.request

    from clipd.cli import main

    server, port = create_server(Settings(**{**TEST_SETTINGS, "admin_token": ADMIN_TOKEN, "admin_port": 0,
                                             "data_dir": str(tmp_path)}))
    base = f"http://127.0.0.1:{server.admin.port}"

    def get(path, token=ADMIN_TOKEN):
        request = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.read().decode()

    try:
        with Client(f"127.0.0.1:{port}", token=ADMIN_TOKEN) as admin:
            sid = admin.create_stream({"w": (WIDTH,)}, l2_norm_clip=CLIP, privacy=(p := privacy(z=1.0, k=5, b=2)),
                                      buffer=Buffer(size=3, max_staleness=4))
            for i in range(3):
                admin.submit_to_stream(sid, {"w": update(i, 1)}, trained_from=0, client_id=f"c{i}")
            released(admin, sid, 1)
            admin.submit_to_stream(sid, {"w": update(3, 1)}, trained_from=0, client_id="c3")  # 1 stale
            admin.submit_to_stream(sid, {"w": update(4, 1)}, trained_from=1, client_id="c4")
            epsilon = admin.ledger(p.ledger_id).epsilon
            view = json.loads(get(f"/api/v1/streams/{sid}"))
            assert json.loads(get("/api/v1/streams"))["streams"] == [view]
            assert (view["state"], view["version"], view["filling_version"], view["last_version"]) == ("open", 1, 2,
                                                                                                    None)
            assert view["buffer"]["filled"] == 2 and view["buffer"]["size"] == 3
            assert view["participation"] == {"max_participations": 5, "min_separation": 2}
            assert view["staleness"]["by_staleness"] == {"0": 4, "1": 1} and view["staleness"]["contributions"] == 5
            assert view["staleness"]["mean"] == pytest.approx(0.2) and view["staleness"]["max"] == 4
            assert (view["ledger_id"], view["mechanism"]) == (p.ledger_id, "independent")
            assert view["ledger_epsilon"] == pytest.approx(epsilon, rel=1e-12) and epsilon > 0
            for path, token, code in [(f"/api/v1/streams/{sid}", None, 401), ("/api/v1/streams/nope", ADMIN_TOKEN, 404)]:
                with pytest.raises(urllib.error.HTTPError) as e:
                    get(path, token)
                assert e.value.code == code
            metrics = get("/metrics")
            key = f'ledger="{p.ledger_id}",stream="{sid}"'
            for line in [f"clipd_buffered_stream_version{{{key}}} 1.0", f"clipd_buffered_stream_open{{{key}}} 1.0",
                         f"clipd_buffered_stream_buffer_filled{{{key}}} 2.0",
                         f"clipd_buffered_stream_buffer_size{{{key}}} 3.0",
                         f'clipd_buffered_stream_staleness_bucket{{le="0",{key}}} 4.0',
                         f'clipd_buffered_stream_staleness_bucket{{le="+Inf",{key}}} 5.0',
                         f"clipd_buffered_stream_staleness_sum{{{key}}} 1.0"]:
                assert line in metrics, line
            admin.stop_stream(sid)
        assert main(["status", "--admin", base, "--token", ADMIN_TOKEN]) == 0
        lines = capsys.readouterr().out.splitlines()
        at = lines.index("1 buffered stream")
        assert lines[at + 1].split() == ["ID", "STATE", "VERSION", "BUFFER", "RELEASES/MIN", "MEAN", "STALENESS",
                                         "LEDGER", "EPSILON"]
        row = lines[at + 2].split()
        assert row[:5] == [sid, "stopped", "1", "0/3", "0.0"] and row[5:7] == ["0.2", p.ledger_id]
        assert float(row[7]) == pytest.approx(epsilon, rel=1e-5)
        assert lines[at + 3].startswith(f"{sid} stopped: ")
    finally:
        server.stop(grace=1.0)
