"""A buffered stream survives SIGKILL of a real ``clipd serve`` process (docs/streams.md): clients submitting as
fast as they can while the server is killed at random moments and restarted; every acknowledged contribution
counts in exactly one version, every version is released once, with exactly the contributions acknowledged into
it (z = 0: the releases are exact sums, each contribution on a coordinate of its own); with ``--processes 2``
too."""

from __future__ import annotations

import random
import threading
import time
import uuid

import numpy as np
import pytest
from service_helpers import ServerProcess, free_port

from clipd.client import Buffer, Client, Privacy

TOKEN = "crash-admin-3f1"
CLIENTS, EACH, SIZE = 6, 12, 4  # 72 contributions: about 18 versions of 4
WIDTH = CLIENTS * EACH


def _contribution(client: int, n: int) -> np.ndarray:
    x = np.zeros(WIDTH, np.float32)
    x[client * EACH + n - 1] = 0.5
    return x


@pytest.mark.parametrize("processes", [0, 2])
def test_sigkill_at_random_moments_loses_nothing_acknowledged_and_releases_each_version_once(tmp_path, processes):
    """One process, or ``--processes 2`` (the control process killed, its shard processes exit with it; the
    contributions reach it through them)."""
    server = ServerProcess(tmp_path / "data", tmp_path / "cache", free_port(),
                           args=("--admin-port", "-1", "--admin-token", TOKEN,
                                 *(("--processes", str(processes)) if processes else ())))
    server.start()
    target = f"127.0.0.1:{server.port}"
    acked: dict[tuple[int, int], int] = {}
    errors: list[BaseException] = []
    try:
        with Client(target, token=TOKEN, retry_timeout=120.0) as admin:
            privacy = Privacy(f"crash-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=0.0, max_participations=100,
                              min_separation=1)
            sid = admin.create_stream({"w": (WIDTH,)}, l2_norm_clip=1.0, privacy=privacy,
                                      buffer=Buffer(size=SIZE, staleness_exponent=0.0, max_staleness=1000,
                                                    max_wait=1.0))  # (the run's last buffers go short)

        def client(i: int) -> None:
            try:
                with Client(target, token=TOKEN, retry_timeout=120.0) as c:
                    for n in range(1, EACH + 1):
                        while True:  # the same contribution (the same sequence) until it is acknowledged
                            try:
                                version = c.stream(sid).version
                                ack = c.submit_to_stream(sid, {"w": _contribution(i, n)}, trained_from=version,
                                                         client_id=f"k{i}", sequence=n)
                                break
                            except Exception as e:  # the server went away mid-call: resend it
                                if "stale" in str(e) or "newest version" in str(e):
                                    raise
                                time.sleep(0.2)
                        acked[(i, n)] = ack.version
            except BaseException as e:  # (reported by the test)
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        rng = random.Random(7)
        for _ in range(3):  # killed at random moments while they submit, restarted each time
            time.sleep(rng.uniform(0.3, 1.5))
            if not any(t.is_alive() for t in threads):
                break
            server.kill()
            server.start()
        for t in threads:
            t.join(240)
        assert not errors, errors
        assert len(acked) == CLIENTS * EACH
        with Client(target, token=TOKEN, retry_timeout=120.0) as admin:
            versions = max(acked.values())
            releases = [r for _, r in zip(range(versions), admin.watch_releases(sid, after=0, timeout=120))]
            ledger = admin.ledger(privacy.ledger_id)
    finally:
        server.stop()
    assert server.kills >= 1
    assert [r.version for r in releases] == list(range(1, versions + 1))
    assert len(ledger.entries) == versions  # each version released once
    seen: dict[int, int] = {}
    for release in releases:
        held = np.flatnonzero(np.abs(release.sums["w"]) > 0.25)
        np.testing.assert_allclose(release.sums["w"][held], 0.5, rtol=1e-6)
        assert release.release.contributions == len(held)
        for index in held:
            assert int(index) not in seen  # no contribution in two versions
            seen[int(index)] = release.version
    assert {(index // EACH, index % EACH + 1): v for index, v in seen.items()} == acked  # each where it was acked
