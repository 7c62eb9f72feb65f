"""PostgresStore against a throwaway PostgreSQL 15 cluster: the durable Store contract, and what a shared store adds.

The session fixture runs Debian's PostgreSQL (``initdb``, ``pg_ctl``; as the
``postgres`` user when the tests run as root) in a temporary directory,
listening on 127.0.0.1 on a free port with trust auth; every test gets a
database of its own. Without ``initdb`` the tests FAIL (scripts/test.sh
installs ``postgresql-15``).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import zlib

import psycopg
import pytest
from test_store import DurableStoreContract, record, state_at

from clipd.server.stores.base import FINALIZED, OPEN, AggregationRecord, LedgerConflict, LedgerEntry, LedgerRecord
from clipd.server.stores.postgres import SCHEMA_VERSION, PostgresStore

PG_BIN = "/usr/lib/postgresql/15/bin"
_TIMEOUT = 60  # seconds for any one cluster command


def _pg_tool(name: str) -> str:
    found = shutil.which(name) or (os.path.join(PG_BIN, name) if os.access(os.path.join(PG_BIN, name), os.X_OK)
                                   else None)
    if found is None:
        pytest.fail(f"{name} (PostgreSQL 15) is not installed: the PostgresStore tests need a throwaway cluster. "
                    f"Install the Debian package postgresql-15 (scripts/test.sh does) or put {PG_BIN} on PATH.")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A PostgreSQL cluster in a temporary directory, owned by ``postgres`` when we are root."""

    def __init__(self) -> None:
        self.initdb, self.pg_ctl = _pg_tool("initdb"), _pg_tool("pg_ctl")
        self.as_root = os.geteuid() == 0
        self.dir = tempfile.mkdtemp(prefix="clipd-pg-")
        if self.as_root:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.data = os.path.join(self.dir, "data")
        self.port = 0
        self._names = itertools.count()

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if self.as_root else []
        done = subprocess.run(prefix + list(argv), cwd=self.dir, capture_output=True, text=True, timeout=_TIMEOUT)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def start(self) -> None:
        self._run(self.initdb, "-D", self.data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8",
                  "--locale=C")
        for _attempt in range(3):  # the port is free when picked; another process may take it first
            self.port = _free_port()
            options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.dir}"
                       " -c max_connections=50")
            done = self._run(self.pg_ctl, "-D", self.data, "-l", os.path.join(self.dir, "log"), "-w", "-t",
                             str(_TIMEOUT), "-o", options, "start", check=False)
            if done.returncode == 0:
                return
        with open(os.path.join(self.dir, "log")) as f:
            raise RuntimeError(f"pg_ctl start failed 3 times:\n{done.stdout}{done.stderr}\n{f.read()[-4000:]}")

    def stop(self) -> None:
        """Stops the cluster at once (``-m immediate``: no shutdown checkpoint, its files go next)."""
        try:
            if os.path.exists(os.path.join(self.data, "postmaster.pid")):
                self._run(self.pg_ctl, "-D", self.data, "-m", "immediate", "-w", "-t", "30", "stop", check=False)
        finally:
            self._kill_leftover()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_leftover(self) -> None:
        """SIGKILL the postmaster if ``pg_ctl stop`` did not end it (its pid from postmaster.pid)."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                os.kill(int(f.readline()), signal.SIGKILL)

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def new_database(self) -> str:
        """A DSN of a new, empty database."""
        name = f"clipd_test_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)


@pytest.fixture(scope="session")
def pg_cluster():
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class TestPostgresStore(DurableStoreContract):
    store_class = PostgresStore

    @pytest.fixture(autouse=True)
    def _cluster(self, pg_cluster):
        self.cluster = pg_cluster

    def new_location(self, tmp_path):
        return self.cluster.new_database()

    def assert_two_generations_kept(self, store, dsn):
        with psycopg.connect(dsn) as conn:
            generations = conn.execute("SELECT generation FROM checkpoints ORDER BY aggregation, generation")
            assert [g for (g,) in generations] == [3, 4, 1]  # two kept per aggregation
            assert conn.execute("SELECT version FROM clipd_schema").fetchall() == [(SCHEMA_VERSION,)]

    def set_schema_version(self, dsn, version):
        with psycopg.connect(dsn) as conn:
            conn.execute("UPDATE clipd_schema SET version = %s", (version,))

    def test_a_version_1_database_opens_with_its_checkpoints_as_shard_0(self):
        from clipd.server.stores import postgres as postgres_store

        dsn = self.cluster.new_database()
        blob = state_at(4).to_bytes()
        with psycopg.connect(dsn) as conn:
            for statement in postgres_store._SCHEMA:
                conn.execute(statement)
            conn.execute("INSERT INTO clipd_schema VALUES (1)")
            conn.execute("INSERT INTO aggregations (id, spec, state, created) VALUES ('old', '{}', 'open', 1.0)")
            conn.execute("INSERT INTO checkpoints VALUES (1, 1, %s, %s, %s)", (len(blob), zlib.crc32(blob), blob))
        store = PostgresStore(dsn)
        try:
            assert store.load_checkpoint("old") == state_at(4)
            assert store.claim_shard("old", 0) == 1
            assert len(store.submit_token_key()) == 32
        finally:
            store.close()
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT version FROM clipd_schema").fetchall() == [(SCHEMA_VERSION,)] == [(5,)]

    def test_processes_sharing_a_database_share_the_submit_token_key(self):
        dsn = self.cluster.new_database()
        first, second = PostgresStore(dsn), PostgresStore(dsn)
        try:
            assert first.submit_token_key() == second.submit_token_key()
        finally:
            first.close()
            second.close()

    @pytest.mark.parametrize("damage", ["flip_byte", "truncate", "crc_agrees"])
    def test_damaged_newest_falls_back_to_previous(self, caplog, damage):
        dsn = self.cluster.new_database()
        store = PostgresStore(dsn)
        try:
            store.create(record("agg-7"))
            store.save_checkpoint("agg-7", state_at(1))
            store.save_checkpoint("agg-7", state_at(2))
            with psycopg.connect(dsn) as conn:
                (blob,) = conn.execute("SELECT blob FROM checkpoints WHERE generation = 2").fetchone()
                blob = bytearray(blob)
                if damage == "truncate":
                    blob = blob[:-10]
                else:
                    blob[len(blob) // 2] ^= 0x01
                conn.execute("UPDATE checkpoints SET blob = %s WHERE generation = 2", (bytes(blob),))
                if damage == "crc_agrees":  # damaged before its row was written: the blob's own checksum
                    conn.execute("UPDATE checkpoints SET crc32 = %s WHERE generation = 2",
                                 (zlib.crc32(blob),))
            with caplog.at_level(logging.WARNING, logger="clipd.server.stores.postgres"):
                assert store.load_checkpoint("agg-7") == state_at(1)
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and "agg-7" in warnings[0] and "generation 2" in warnings[0]
            assert store.load_checkpoint("agg-7", newest_only=True) is None  # a final result: none, not older
        finally:
            store.close()

    def test_stale_position_from_another_process_is_a_conflict_and_writes_nothing(self):
        """Two stores on one database (two clipd processes): the second release at one position loses."""
        dsn = self.cluster.new_database()
        first, second = PostgresStore(dsn), PostgresStore(dsn)
        try:
            first.ensure_ledger(LedgerRecord("L", "{}"))
            for aggregation_id in ("a", "b"):
                first.create(AggregationRecord(aggregation_id, "{}"))
                first.save_checkpoint(aggregation_id, state_at(1))
            position = len(second.ledger_entries("L"))  # both read 0 entries
            assert position == len(first.ledger_entries("L")) == 0
            first.commit_release("a", b"ra", "L", LedgerEntry("a", "{}", 1.0, 1.0), position, finished=2.0)
            with pytest.raises(LedgerConflict):
                second.commit_release("b", b"rb", "L", LedgerEntry("b", "{}", 1.0, 2.0), position, finished=3.0)
            for store in (first, second):
                assert [e.aggregation_id for e in store.ledger_entries("L")] == ["a"]
                assert store.load_release("b") is None
                assert store.get("b").state == OPEN and store.load_checkpoint("b") == state_at(1)
            # Re-read, the second process releases at the next position.
            second.commit_release("b", b"rb", "L", LedgerEntry("b", "{}", 1.0, 2.0), 1, finished=3.0)
            assert [e.aggregation_id for e in first.ledger_entries("L")] == ["a", "b"]
            assert first.load_release("b") == b"rb"
        finally:
            first.close()
            second.close()

    def test_concurrent_releases_take_distinct_positions(self):
        """Threads on separate connections race to append: each position is taken exactly once."""
        dsn = self.cluster.new_database()
        stores = [PostgresStore(dsn) for _ in range(4)]
        try:
            stores[0].ensure_ledger(LedgerRecord("L", "{}"))
            for k in range(len(stores)):
                stores[0].create(AggregationRecord(f"a{k}", "{}"))
            errors: list[BaseException] = []

            def work(k: int) -> None:
                store = stores[k]
                try:
                    while True:
                        position = len(store.ledger_entries("L"))
                        try:
                            store.commit_release(f"a{k}", b"r", "L", LedgerEntry(f"a{k}", "{}", 0.0, 1.0),
                                                 position, finished=1.0)
                            return
                        except LedgerConflict:
                            continue
                except BaseException as e:  # reported below
                    errors.append(e)

            workers = [threading.Thread(target=work, args=(k,)) for k in range(len(stores))]
            for w in workers:
                w.start()
            for w in workers:
                w.join(timeout=60)
            assert not any(w.is_alive() for w in workers) and errors == []
            assert sorted(e.aggregation_id for e in stores[0].ledger_entries("L")) == [f"a{k}" for k in range(4)]
        finally:
            for store in stores:
                store.close()

    def test_a_commit_survives_killing_the_client(self):
        dsn = self.cluster.new_database()
        child = "\n".join([
            "from __future__ import annotations",
            "import sys, time",
            "import numpy as np",
            "from clipd.engine import NUM_BUCKETS, LayerSpec, PartialState",
            "from clipd.server.stores.postgres import PostgresStore",
            "from clipd.server.stores.base import AggregationRecord",
            inspect.getsource(state_at),
            "store = PostgresStore(sys.argv[1])",
            "store.create(AggregationRecord('agg', '{}', created=5.0))",
            "store.save_checkpoint('agg', state_at(3))",
            "print('saved', flush=True)",
            "time.sleep(120)",
        ])
        proc = subprocess.Popen([sys.executable, "-c", child, dsn], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            line = proc.stdout.readline().strip()  # the child returned from save_checkpoint
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        stderr = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
        assert line == "saved", stderr
        assert proc.returncode == -signal.SIGKILL, stderr
        store = PostgresStore(dsn)
        try:
            assert store.get("agg") == AggregationRecord("agg", "{}", created=5.0)
            assert store.load_checkpoint("agg") == state_at(3)
        finally:
            store.close()

    def test_reconnects_after_the_server_drops_the_connection(self):
        dsn = self.cluster.new_database()
        store = PostgresStore(dsn)
        try:
            store.create(record("a"))
            (pid,) = store._query("SELECT pg_backend_pid()")[0]
            with psycopg.connect(self.cluster.dsn(), autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            with pytest.raises(psycopg.OperationalError):
                store.get("a")  # this call finds the connection gone
            assert store.get("a") == record("a")  # the next one reconnects
        finally:
            store.close()


def test_a_server_on_postgresql_keeps_its_shards_and_tokens_across_a_restart(pg_cluster):
    """The whole server on the shared store: 2 shards, a restart, the same submit token, an exact sum."""
    import numpy as np
    from conftest import TEST_SETTINGS

    from clipd.client import Client
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    settings = Settings(**{**TEST_SETTINGS, "data_dir": pg_cluster.new_database(), "shards": 2,
                           "admin_token": "admin"})
    rng = np.random.default_rng(5)
    batches = {c: rng.standard_normal((2, 6, 3)).astype(np.float32) for c in ("alice", "bob", "carol")}
    server, port = create_server(settings)
    try:
        with Client(f"127.0.0.1:{port}", token="admin") as c:
            aggregation = c.create_aggregation({"w": (3,)}, l2_norm_clip=1.0, aggregation_id="on-pg")
            token = c.get_aggregation(aggregation).submit_token
        with Client(f"127.0.0.1:{port}", token=token) as c:
            for client, x in batches.items():
                c.submit(aggregation, {"w": x[0]}, client_id=client)
    finally:
        server.stop(1.0)
    server, port = create_server(settings)  # recovers every shard from PostgreSQL
    try:
        with Client(f"127.0.0.1:{port}", token=token) as c:  # the key lives in the database: the token holds
            for client, x in batches.items():
                c.submit(aggregation, {"w": x[1]}, client_id=client)
        with Client(f"127.0.0.1:{port}", token="admin") as c:
            result = c.finalize(aggregation)
    finally:
        server.stop(1.0)
    x = np.concatenate([b.reshape(-1, 3) for b in batches.values()]).astype(np.float64)
    expected = np.minimum(1.0, 1.0 / np.linalg.norm(x, axis=1)) @ x
    assert result.examples == 36
    np.testing.assert_allclose(result.sums["w"], expected, rtol=1e-6)
    store = PostgresStore(settings.data_dir)
    try:
        shards = [store.load_checkpoint("on-pg", shard=k) for k in range(2)]
        assert sorted(c for s in shards for c in s.clients) == ["alice", "bob", "carol"]
        assert all(s.clients for s in shards)  # both shards hold a client (crc32 % 2: alice 1, bob 0, carol 1)
        assert store.get("on-pg").state == FINALIZED
    finally:
        store.close()


def test_a_second_server_on_the_same_database_fences_the_first_out(pg_cluster):
    """A takeover (a rolling update): B claims every open shard; A's next checkpoint is refused, A's
    aggregation fails, and B holds everything A acknowledged, nothing twice."""
    import numpy as np
    from conftest import TEST_SETTINGS

    from clipd.client import Client, ClipdError
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    settings = Settings(**{**TEST_SETTINGS, "data_dir": pg_cluster.new_database(), "shards": 2})
    x = np.random.default_rng(9).standard_normal((3, 5, 4)).astype(np.float32)
    first, first_port = create_server(settings)
    try:
        with Client(f"127.0.0.1:{first_port}") as c:
            c.create_aggregation({"w": (4,)}, l2_norm_clip=1.0, aggregation_id="taken-over")
            c.submit("taken-over", {"w": x[0]}, client_id="alice")  # acknowledged by A
        second, second_port = create_server(settings)  # B recovers the aggregation and claims its shards
        try:
            with Client(f"127.0.0.1:{first_port}", retry_timeout=5) as c:
                with pytest.raises(ClipdError, match="FencedOut|failed"):  # A may no longer commit
                    c.submit("taken-over", {"w": x[1]}, client_id="bob")
            with Client(f"127.0.0.1:{second_port}") as c:
                c.submit("taken-over", {"w": x[2]}, client_id="carol")
                result = c.finalize("taken-over")
        finally:
            second.stop(1.0)
    finally:
        first.stop(1.0)
    kept = np.concatenate([x[0], x[2]]).astype(np.float64)  # A's acknowledged batch and B's; not A's refused one
    np.testing.assert_allclose(result.sums["w"], np.minimum(1.0, 1.0 / np.linalg.norm(kept, axis=1)) @ kept,
                               rtol=1e-6)
    assert result.examples == 10


def test_a_second_server_on_the_same_database_continues_a_correlated_stream(pg_cluster):
    """Server A makes releases 0 and 1 of a seeded BLT ledger and goes away; server B, on the same database,
    makes release 2 of the same stream: every release equals bit for bit those of a ledger run on B alone
    (same seed and data)."""
    import numpy as np
    from conftest import TEST_SETTINGS

    from clipd.client import Client, Privacy
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    dsn = pg_cluster.new_database()
    fields = dict(delta=1e-5, noise_multiplier=1.0, seed=5, mechanism="blt", releases=6, min_separation=2,
                  max_participations=3, buffers=2)  # (the strategy of test_correlated_service's streams)
    data = [{"w": np.full((2, 6), 0.05 * (t + 1), np.float32)} for t in range(3)]

    def release(client, ledger, t):
        aggregation = client.create_aggregation({"w": (6,)}, l2_norm_clip=1.0, privacy=Privacy(ledger, **fields))
        client.submit(aggregation, data[t], client_id=f"c{t}")
        return client.finalize(aggregation)

    settings = Settings(**{**TEST_SETTINGS, "data_dir": dsn})
    first, port = create_server(settings)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            moved = [release(client, "moved", t) for t in range(2)]
    finally:
        first.stop(grace=0.5)
    second, port = create_server(settings)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            moved.append(release(client, "moved", 2))
            calm = [release(client, "calm", t) for t in range(3)]
            assert [r.release.stream_release for r in moved] == [0, 1, 2]
            for a, b in zip(moved, calm):
                np.testing.assert_array_equal(a.sums["w"], b.sums["w"])
            assert client.ledger("moved").stream_made == 3
    finally:
        second.stop(grace=0.5)
