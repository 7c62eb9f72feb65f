"""A privacy ledger survives SIGKILL of a real ``clipd serve`` process, and refuses the same way afterwards.

Also: a kill at a random point of Finalize never leaves a release without its
ledger entry, or an entry without its release, or either without its place in
the ledger's canary audit (one transaction).
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
from service_helpers import ServerProcess, free_port

from clipd.client import Audit, Client, ClipdError, FailedPreconditionError, Privacy


def _client(port: int) -> Client:
    return Client(f"127.0.0.1:{port}", retry_timeout=60.0)


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """One ``clipd serve`` process for the module, on one data directory: each test kills and restarts it and
    works on ledgers and aggregations of its own (a start is ~3 s of imports: paid once, not once per test)."""
    root = tmp_path_factory.mktemp("privacy-crash")
    proc = ServerProcess(root / "data", root / "cache", free_port())
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture()
def proc(server_process):
    """The module's server, running (started when none is: the first test, or one after a failure between a
    kill and its restart)."""
    if server_process.proc is None or server_process.proc.poll() is not None:
        server_process.start()
    return server_process


def test_ledger_survives_sigkill_and_refuses_the_same_way(proc):
    privacy = Privacy("survivor", 1e-5, noise_multiplier=1.0, max_epsilon=8.0)  # 2 releases fit, 3 don't
    with _client(proc.port) as client:
        released = []
        for _ in range(2):
            agg = client.create_aggregation({"w": (16,)}, l2_norm_clip=1.0, privacy=privacy)
            client.submit(agg, {"w": np.ones((3, 16), np.float32)})
            released.append((agg, client.finalize(agg)))
        with pytest.raises(FailedPreconditionError) as before:
            client.create_aggregation({"w": (16,)}, l2_norm_clip=1.0, privacy=privacy)
        ledger_before = client.ledger("survivor")
        # Another ledger: one release made, one reserved by an aggregation still open at the kill.
        reserving = Privacy("reserving", 1e-5, noise_multiplier=1.0, max_epsilon=8.0)
        client.finalize(client.create_aggregation({"w": (16,)}, l2_norm_clip=1.0, privacy=reserving))
        still_open = client.create_aggregation({"w": (16,)}, l2_norm_clip=1.0, privacy=reserving)
        with pytest.raises(FailedPreconditionError, match="1 more releases reserved") as reserved_before:
            client.create_aggregation({"w": (16,)}, l2_norm_clip=1.0, privacy=reserving)
        # Secure noise: a release made, and an open fixed-point sum with one client's rows acknowledged.
        secure = Privacy("secure-survivor", 1e-5, noise_multiplier=1.0, noise="secure", accountant="zcdp")
        secure_released = client.create_aggregation({"w": (16,)}, l2_norm_clip=1.0, privacy=secure)
        client.submit(secure_released, {"w": np.ones((3, 16), np.float32)})
        released.append((secure_released, client.finalize(secure_released)))
        exact = Privacy("secure-exact", 1e-5, noise_multiplier=0.0, noise="secure", accountant="zcdp")
        summing = client.create_aggregation({"w": (500,)}, l2_norm_clip=1.0, privacy=exact)
        rows = [(np.random.default_rng(k).standard_normal((4, 500)) * 0.01).astype(np.float32) for k in (1, 2)]
        client.submit(summing, {"w": rows[0]}, client_id="before-the-kill")
    proc.kill()
    proc.start()
    with _client(proc.port) as client:
        ledger_after = client.ledger("survivor")
        assert ledger_after == ledger_before  # entries, events, epsilon, budget: all of it
        with pytest.raises(FailedPreconditionError) as after:
            client.create_aggregation({"w": (16,)}, l2_norm_clip=1.0, privacy=privacy)
        assert after.value.details == before.value.details
        with pytest.raises(FailedPreconditionError) as reserved_after:  # the open one's reservation came back
            client.create_aggregation({"w": (16,)}, l2_norm_clip=1.0, privacy=reserving)
        assert reserved_after.value.details == reserved_before.value.details
        assert client.finalize(still_open).release.ledger_releases == 2
        client.submit(summing, {"w": rows[1]}, client_id="after-the-kill")
        result = client.finalize(summing)  # the checkpointed fixed-point sum went on exactly
        step = result.release.grid_step
        expected = sum(np.rint(r.astype(np.float64) / step).sum(axis=0) for r in rows) * step
        np.testing.assert_array_equal(result.sums["w"], expected)
        for agg, result in released:  # the releases themselves came back, not new noise
            again = client.finalize(agg)
            np.testing.assert_array_equal(again.sums["w"], result.sums["w"])
            assert again.release == result.release


def test_sigkill_during_finalize_never_splits_a_release_from_its_ledger_entry(proc):
    rng = random.Random(20261123)
    privacy = Privacy("atomic", 1e-5, noise_multiplier=1.0, audit=Audit(canaries=100))
    aggregations = []
    # Two kills (there were three: the seeded delays, 0.113, 0.135 and 0.098 s, all land before the release is
    # committed here, so the third was the same case again, for a restart of ~3 s).
    for _ in range(2):
        with _client(proc.port) as client:
            agg = client.create_aggregation({"w": (4096,)}, l2_norm_clip=1.0, privacy=privacy)
            client.submit(agg, {"w": np.ones((8, 4096), np.float32)})
            aggregations.append(agg)

            _kill_during_finalize(proc, client, agg, rng.uniform(0.0, 0.15))
        proc.start()
        with _client(proc.port) as client:
            ledger = client.ledger("atomic")
            entries = [e.aggregation_id for e in ledger.entries]  # made at creation
            assert ledger.audit.releases == len(entries)  # the audit's state is committed with each release
            for seen in aggregations:
                state = client.get_aggregation(seen).state
                finalized = state == 3  # Aggregation.FINALIZED
                assert finalized == (seen in entries), (seen, state, entries)
                assert entries.count(seen) <= 1
    with _client(proc.port) as client:  # every one can still be released, exactly once
        for agg in aggregations:
            client.finalize(agg)
        ledger = client.ledger("atomic")
        entries = [e.aggregation_id for e in ledger.entries]
        assert sorted(entries) == sorted(aggregations) and ledger.audit.releases == len(aggregations)



def test_a_correlated_stream_survives_sigkill_during_finalize_bit_for_bit(proc):
    """A BLT ledger of 2 releases, seeded: the server is killed at a random point of each Finalize, then
    restarted and asked again. Every release is made once, in order, and equals bit for bit the same
    ledger's releases made without a kill (another ledger, same seed and data, on the same server).

    The calm ledger is released first: its BLT is optimized (jax_privacy, ~6 s) in the process the killed
    ledger's first aggregation is then created in, whose cache serves it (the killed ledger's strategy is
    read back from its ledger after each restart, as before)."""
    rng = random.Random(20261125)
    fields = dict(delta=1e-5, noise_multiplier=1.0, seed=99, mechanism="blt", releases=2, min_separation=1,
                  max_participations=2, buffers=1)
    data = [{"w": np.full((2, 8), 0.1 * (t + 1), np.float32)} for t in range(2)]
    with _client(proc.port) as client:
        calm = []
        for t in range(2):
            agg = client.create_aggregation({"w": (8,)}, l2_norm_clip=1.0, privacy=Privacy("calm", **fields))
            client.submit(agg, data[t])
            calm.append(client.finalize(agg))
    killed = []
    for t in range(2):
        with _client(proc.port) as client:
            agg = client.create_aggregation({"w": (8,)}, l2_norm_clip=1.0, privacy=Privacy("killed", **fields))
            client.submit(agg, data[t])
            _kill_during_finalize(proc, client, agg, rng.uniform(0.0, 0.1))
        proc.start()
        with _client(proc.port) as client:
            killed.append(client.finalize(agg))  # made now, or already made before the kill: the same
    with _client(proc.port) as client:
        assert [r.release.stream_release for r in killed] == [0, 1]
        for a, b in zip(killed, calm):
            np.testing.assert_array_equal(a.sums["w"], b.sums["w"])
            assert a.release.ledger_epsilon == b.release.ledger_epsilon
        ledger = client.ledger("killed")
        assert (len(ledger.entries), ledger.stream_made) == (2, 2)


def _kill_during_finalize(proc: ServerProcess, client: Client, aggregation: str, after: float) -> None:
    """Finalize on a thread, and SIGKILL of the server ``after`` seconds into it."""
    worker = threading.Thread(target=_finalize_quietly, args=(client, aggregation), daemon=True)
    worker.start()
    time.sleep(after)
    proc.kill()
    # A Finalize cut by the kill is retried (the client's retry_timeout) until the caller closes the client:
    # waiting for it is waiting for nothing. 0.1 s (it was 1 s, per kill) lets one answered in time arrive.
    worker.join(timeout=0.1)


def _finalize_quietly(client: Client, aggregation: str) -> None:
    try:
        client.finalize(aggregation)
    except (ClipdError, ValueError):
        pass  # the server died under it, or the test closed the channel first
