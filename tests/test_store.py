"""The Store contract, run against every implementation, and the durability of SQLiteStore.

:class:`StoreContract` holds what every store must do (``MemoryStore``, SQLite
and PostgreSQL); :class:`DurableStoreContract` what every durable one adds
(SQLite here, PostgreSQL in ``test_postgres_store.py``): surviving a reopen,
refusing a newer schema. :class:`TestSQLiteStore` adds what only SQLite's files
can show: falling back past damaged checkpoint files, sweeping crash
leftovers, and a writer process killed with SIGKILL at random moments.
"""

from __future__ import annotations

import fcntl
import inspect
import logging
import math
import os
import pathlib
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
from helpers import wait_until

from clipd.engine import NUM_BUCKETS, LayerSpec, PartialState
from clipd.server.stores import open_store
from clipd.server.stores.base import (
    FAILED,
    FINALIZED,
    OPEN,
    AggregationRecord,
    AuditRecord,
    FencedOut,
    LedgerConflict,
    LedgerEntry,
    LedgerRecord,
    MemoryStore,
    NoiseStream,
    Store,
)
from clipd.server.stores.sqlite import SCHEMA_VERSION, SQLiteStore


def state_at(n: int) -> PartialState:
    """A partial state determined by ``n`` alone, with values that survive no lossy round trip.

    Self-contained (but for the module's imports): the SIGKILL test runs its source in a child.
    """
    layers = (LayerSpec("w", (2, 3)), LayerSpec("b", (3,), "float64"))
    rng = np.random.default_rng(n)
    return PartialState.empty(layers).absorb_totals(
        sums=[rng.normal(size=(2, 3)) / 3.0, np.array([n / 7.0, -0.0, 1e-300])],
        examples=n, non_finite=n % 3, clip_counts=np.array([n, n // 2]),
        layer_histograms=rng.integers(0, 1000, size=(2, NUM_BUCKETS)),
        example_histogram=rng.integers(0, 1000, size=NUM_BUCKETS),
        norm_sum=rng.uniform(0, 10, size=2), norm_max=rng.uniform(0, 10, size=2),
        clients={"alice": (n, "w1"), "bob": (2 * n + 1, f"writer-{n}")}, batches=n + 1, nbytes=100 * n)


def record(aggregation_id: str, created: float = 1.0, spec: str = '{"layers": []}') -> AggregationRecord:
    return AggregationRecord(aggregation_id, spec, created=created)


class StoreContract:
    """Every test a Store implementation must pass; subclasses supply ``make_store``."""

    def make_store(self, tmp_path: pathlib.Path) -> Store:
        raise NotImplementedError

    @pytest.fixture()
    def store(self, tmp_path):
        store = self.make_store(tmp_path)
        yield store
        store.close()

    def test_create_then_get(self, store):
        rec = AggregationRecord("a1", '{"x": 1}', created=12.5)
        assert store.get("a1") is None
        assert store.create(rec) is True
        assert store.get("a1") == rec
        assert store.get("a2") is None

    def test_create_twice_returns_false_and_keeps_the_first(self, store):
        first = AggregationRecord("dup", '{"v": 1}', created=1.0)
        assert store.create(first)
        assert store.create(AggregationRecord("dup", '{"v": 2}', created=2.0, state=FAILED)) is False
        assert store.get("dup") == first
        assert store.records() == [first]

    def test_records_oldest_first(self, store):
        for aggregation_id, created in [("c", 3.0), ("a", 1.0), ("b2", 2.0), ("b1", 2.0)]:
            assert store.create(record(aggregation_id, created))
        # Equal times keep the order of creation.
        assert [r.aggregation_id for r in store.records()] == ["a", "b2", "b1", "c"]

    def test_ids_that_look_like_paths(self, store):
        ids = [".", "..", "../x", "a/b", "", "é 😀"]
        for k, aggregation_id in enumerate(ids):
            assert store.create(record(aggregation_id, created=float(k)))
            store.save_checkpoint(aggregation_id, state_at(k + 1))
        assert [r.aggregation_id for r in store.records()] == ids
        for k, aggregation_id in enumerate(ids):
            assert store.load_checkpoint(aggregation_id) == state_at(k + 1)

    def test_set_state(self, store):
        store.create(record("a"))
        store.set_state("a", FAILED, reason="device on fire", finished=42.0)
        got = store.get("a")
        assert (got.state, got.reason, got.finished) == (FAILED, "device on fire", 42.0)
        store.set_state("a", OPEN)
        got = store.get("a")
        assert (got.state, got.reason, got.finished) == (OPEN, "", None)

    def test_set_state_errors(self, store):
        store.create(record("a"))
        with pytest.raises(ValueError):
            store.set_state("a", "paused")
        with pytest.raises(KeyError):
            store.set_state("nope", FAILED)
        assert store.get("a").state == OPEN
        assert store.get("nope") is None

    def test_checkpoint_round_trip_is_exact(self, store):
        store.create(record("a"))
        assert store.load_checkpoint("a") is None
        assert store.load_checkpoint("unknown") is None
        state = state_at(5)
        store.save_checkpoint("a", state)
        loaded = store.load_checkpoint("a")
        assert loaded == state
        assert loaded.clients == {"alice": (5, "w1"), "bob": (11, "writer-5")}
        assert loaded != state_at(6)

    def test_newest_checkpoint_wins(self, store):
        store.create(record("a"))
        store.create(record("b"))
        for n in (1, 2, 3):
            store.save_checkpoint("a", state_at(n))
        store.save_checkpoint("b", state_at(10))
        assert store.load_checkpoint("a") == state_at(3)
        assert store.load_checkpoint("b") == state_at(10)

    def test_the_final_checkpoint_stays_once_finalized(self, store):
        store.create(record("a"))
        store.save_checkpoint("a", state_at(1))
        assert store.get("a").state == OPEN
        store.save_checkpoint("a", state_at(2))
        store.set_state("a", FINALIZED, finished=99.5)
        got = store.get("a")
        assert (got.state, got.finished) == (FINALIZED, 99.5)
        assert store.load_checkpoint("a") == state_at(2)

    def test_save_checkpoint_on_unknown_id_raises(self, store):
        with pytest.raises(KeyError):
            store.save_checkpoint("ghost", state_at(1))
        with pytest.raises(KeyError):
            store.save_checkpoint("ghost", state_at(1), shard=2, epoch=1)
        assert store.get("ghost") is None
        assert store.load_checkpoint("ghost") is None

    def test_delete(self, store):
        store.create(record("a"))
        store.create(record("b"))
        store.save_checkpoint("a", state_at(1))
        store.save_checkpoint("b", state_at(2))
        store.delete("a")
        store.delete("a")  # again: no error
        store.delete("never-existed")
        assert store.get("a") is None
        assert store.load_checkpoint("a") is None
        assert [r.aggregation_id for r in store.records()] == ["b"]
        assert store.load_checkpoint("b") == state_at(2)
        # The id can be reused, without the old checkpoints.
        assert store.create(record("a"))
        assert store.load_checkpoint("a") is None

    def test_threads_checkpoint_concurrently(self, store):
        threads, saves = 4, 6
        ids = [f"t{k}" for k in range(threads)]
        for aggregation_id in ids:
            store.create(record(aggregation_id))
        errors: list[BaseException] = []

        def work(k: int) -> None:
            try:
                for n in range(1, saves + 1):
                    store.save_checkpoint(ids[k], state_at(100 * k + n))
                    store.get(ids[k])
                    store.records()
            except BaseException as e:  # reported below
                errors.append(e)

        workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=30)
        assert not any(w.is_alive() for w in workers)
        assert errors == []
        for k, aggregation_id in enumerate(ids):
            assert store.load_checkpoint(aggregation_id) == state_at(100 * k + saves)

    # Privacy ledgers ------------------------------------------------------------------------
    def test_shards_have_checkpoints_of_their_own(self, store):
        store.create(record("a"))
        store.save_checkpoint("a", state_at(1), shard=0)
        store.save_checkpoint("a", state_at(2), shard=3)
        for n in (3, 4, 5):  # generations of shard 3 must not push out shard 0's only one
            store.save_checkpoint("a", state_at(n), shard=3)
        assert store.load_checkpoint("a") == state_at(1)
        assert store.load_checkpoint("a", shard=0) == state_at(1)
        assert store.load_checkpoint("a", shard=3) == state_at(5)
        assert store.load_checkpoint("a", shard=1) is None

    def test_claiming_a_shard_fences_out_the_previous_owner(self, store):
        store.create(record("a"))
        with pytest.raises(KeyError):
            store.claim_shard("ghost", 0)
        first = store.claim_shard("a", 1)
        assert store.claim_shard("a", 2) == 1  # epochs count per shard
        store.save_checkpoint("a", state_at(1), shard=1, epoch=first)
        second = store.claim_shard("a", 1)  # a new owner: the old one is believed dead
        assert second == first + 1
        with pytest.raises(FencedOut):
            store.save_checkpoint("a", state_at(99), shard=1, epoch=first)  # it was not: refused
        with pytest.raises(FencedOut):  # again: still refused
            store.save_checkpoint("a", state_at(99), shard=1, epoch=first)
        assert store.load_checkpoint("a", shard=1) == state_at(1)
        assert store.get("a").state == OPEN
        store.save_checkpoint("a", state_at(2), shard=1, epoch=second)
        assert store.load_checkpoint("a", shard=1) == state_at(2)
        with pytest.raises(FencedOut):  # an epoch never claimed is no owner either
            store.save_checkpoint("a", state_at(3), shard=1, epoch=second + 1)

    def test_a_release_drops_every_shard_and_delete_forgets_epochs(self, store):
        store.ensure_ledger(LedgerRecord("L", "{}", 1.0))
        for aggregation_id in ("a", "b"):
            store.create(record(aggregation_id))
            for shard in range(3):
                store.save_checkpoint(aggregation_id, state_at(shard + 1), shard=shard)
        store.commit_release("a", b"noised", "L", LedgerEntry("a", "{}", 2.0, 0.5), 0, 2.0)
        assert [store.load_checkpoint("a", shard=k) for k in range(3)] == [None] * 3
        assert store.claim_shard("b", 0) == 1
        store.delete("b")
        store.create(record("b"))  # the same id again: a new aggregation, epochs from 1
        assert store.load_checkpoint("b", shard=2) is None
        assert store.claim_shard("b", 0) == 1

    def test_the_submit_token_key_is_made_once(self, store):
        key = store.submit_token_key()
        assert isinstance(key, bytes) and len(key) == 32
        assert store.submit_token_key() == key

    def test_ensure_ledger_keeps_the_first_record(self, store):
        first = LedgerRecord("L", '{"delta": 1e-05}', created=3.0)
        assert store.ensure_ledger(first) == first
        assert store.ensure_ledger(LedgerRecord("L", '{"delta": 1e-06}', created=4.0)) == first
        assert [r.ledger_id for r in store.ledgers()] == ["L"]
        assert store.ledger_entries("L") == [] and store.ledger_entries("nope") == []

    def test_commit_release_is_one_step_and_entries_keep_their_order(self, store):
        store.ensure_ledger(LedgerRecord("L", "{}", created=1.0))
        for k, aggregation_id in enumerate(["r1", "r2"]):
            store.create(AggregationRecord(aggregation_id, "{}", created=float(k)))
            store.save_checkpoint(aggregation_id, state_at(k + 1))
            entry = LedgerEntry(aggregation_id, f'{{"e": {k}}}', time=10.0 + k, epsilon_after=1.5 * (k + 1),
                                next_bound=0.5 if k else None)
            store.commit_release(aggregation_id, b"release-%d" % k, "L", entry, k, finished=20.0 + k)
            assert store.get(aggregation_id).state == FINALIZED and store.get(aggregation_id).finished == 20.0 + k
            assert store.load_release(aggregation_id) == b"release-%d" % k
            assert store.load_checkpoint(aggregation_id) is None  # only the release is kept
        entries = store.ledger_entries("L")
        assert [e.aggregation_id for e in entries] == ["r1", "r2"]
        assert entries[1] == LedgerEntry("r2", '{"e": 1}', 11.0, 3.0, 0.5) and entries[0].next_bound is None
        assert store.ledger_entries("L", start=1) == entries[1:]  # what a reader has not seen yet
        assert store.ledger_entries("L", start=2) == [] and store.ledger_entries("nope", start=1) == []

    def test_a_release_can_make_its_record_and_delete_another_aggregation_in_its_commit(self, store):
        """A DP-SGD step's commit: its record made with its release (FINALIZED at once), the step before deleted
        (its release gone, its ledger entry kept); a record whose id exists writes nothing, the step before stays."""
        store.ensure_ledger(LedgerRecord("L", "{}"))
        store.create(AggregationRecord("before", "{}"))
        store.commit_release("before", b"r0", "L", LedgerEntry("before", "{}", 0.0, 1.0), 0, finished=1.0)
        made = AggregationRecord("step", '{"layers": []}', created=2.0)
        store.commit_release("step", b"r1", "L", LedgerEntry("step", "{}", 3.0, 2.0), 1, finished=4.0,
                             record=made, drop="before")
        got = store.get("step")
        assert (got.spec, got.created, got.state, got.finished) == ('{"layers": []}', 2.0, FINALIZED, 4.0)
        assert store.load_release("step") == b"r1"
        assert store.get("before") is None and store.load_release("before") is None
        assert [e.aggregation_id for e in store.ledger_entries("L")] == ["before", "step"]
        with pytest.raises(KeyError):  # its id exists: nothing of the commit is written
            store.commit_release("step", b"r2", "L", LedgerEntry("step", "{}", 5.0, 3.0), 2, finished=6.0,
                                 record=made, drop="step")
        assert store.load_release("step") == b"r1" and len(store.ledger_entries("L")) == 2

    def test_a_stale_position_is_a_conflict_and_writes_nothing(self, store):
        store.ensure_ledger(LedgerRecord("L", "{}"))
        store.create(AggregationRecord("a", "{}"))
        store.save_checkpoint("a", state_at(1))
        with pytest.raises(LedgerConflict):
            store.commit_release("a", b"x", "L", LedgerEntry("a", "{}", 0.0, 1.0), 1, finished=5.0)
        assert store.ledger_entries("L") == [] and store.load_release("a") is None
        assert store.get("a").state == OPEN and store.load_checkpoint("a") == state_at(1)

    def test_create_can_append_a_ledger_entry_in_the_same_commit(self, store):
        store.ensure_ledger(LedgerRecord("L", "{}"))
        entry = LedgerEntry("d", '{"class_name": "NonPrivateDpEvent"}', 1.0, math.inf)
        assert store.create(AggregationRecord("d", "{}"), ledger_entry=("L", entry)) is True
        assert store.ledger_entries("L") == [entry]
        assert store.create(AggregationRecord("d", "{}"), ledger_entry=("L", entry)) is False  # exists: nothing
        assert store.ledger_entries("L") == [entry]

    def test_deleting_an_aggregation_keeps_its_ledger_entries(self, store):
        store.ensure_ledger(LedgerRecord("L", "{}"))
        store.create(AggregationRecord("a", "{}"))
        store.commit_release("a", b"r", "L", LedgerEntry("a", "{}", 0.0, 1.0), 0, finished=1.0)
        store.delete("a")
        assert store.get("a") is None and store.load_release("a") is None
        assert [e.aggregation_id for e in store.ledger_entries("L")] == ["a"]  # privacy spent stays spent


    def test_a_release_keeps_the_ledgers_noise_stream_and_participations_in_its_commit(self, store):
        """The stream's state replaces the one before with each release; participations stay; a conflicting
        position writes neither."""
        store.ensure_ledger(LedgerRecord("L", "{}"))
        assert store.noise_stream("L") is None and store.participations("L", "alice") == []
        for k in range(3):
            store.create(AggregationRecord(f"r{k}", "{}"))
            store.commit_release(f"r{k}", b"r", "L", LedgerEntry(f"r{k}", "{}", 0.0, 1.0), k, finished=1.0,
                                 stream=NoiseStream(k + 1, b"state-%d" % k), participants=["alice"] if k != 1 else ["bob"])
        assert store.noise_stream("L") == NoiseStream(3, b"state-2")
        assert store.participations("L", "alice") == [0, 2] and store.participations("L", "bob") == [1]
        store.create(AggregationRecord("late", "{}"))
        with pytest.raises(LedgerConflict):
            store.commit_release("late", b"r", "L", LedgerEntry("late", "{}", 0.0, 1.0), 1, finished=1.0,
                                 stream=NoiseStream(2, b"stale"), participants=["carol"])
        assert store.noise_stream("L") == NoiseStream(3, b"state-2") and store.participations("L", "carol") == []
        store.delete("r2")
        assert store.noise_stream("L") == NoiseStream(3, b"state-2")  # the ledger's, not the aggregation's

    def test_a_ledgers_audit_is_made_once_replaced_with_its_releases_and_closed_for_good(self, store):
        """The first audit made stays (a second ``create`` returns it); each release's commit replaces it, a
        conflicting position writes nothing, and once a closed one is stored nothing replaces it (a release
        that read it open and commits after the close leaves the close as it is)."""
        store.ensure_ledger(LedgerRecord("L", "{}"))
        assert store.ledger_audit("L") is None
        assert store.save_ledger_audit("L", AuditRecord(b"audit-0"), create=True) == b"audit-0"
        assert store.save_ledger_audit("L", AuditRecord(b"another"), create=True) == b"audit-0"
        store.create(AggregationRecord("r", "{}"))
        store.commit_release("r", b"r", "L", LedgerEntry("r", "{}", 0.0, 1.0), 0, finished=1.0,
                             audit=AuditRecord(b"audit-1"))
        assert store.ledger_audit("L") == b"audit-1"
        store.create(AggregationRecord("late", "{}"))
        with pytest.raises(LedgerConflict):
            store.commit_release("late", b"r", "L", LedgerEntry("late", "{}", 0.0, 1.0), 0, finished=1.0,
                                 audit=AuditRecord(b"stale"))
        assert store.ledger_audit("L") == b"audit-1"
        assert store.save_ledger_audit("L", AuditRecord(b"closed", closed=True)) == b"closed"
        store.create(AggregationRecord("after", "{}"))
        store.commit_release("after", b"r", "L", LedgerEntry("after", "{}", 0.0, 1.0), 1, finished=1.0,
                             audit=AuditRecord(b"read-open"))
        assert store.ledger_audit("L") == b"closed" and len(store.ledger_entries("L")) == 2
        assert store.save_ledger_audit("L", AuditRecord(b"again")) == b"closed"
        assert store.ledger_audit("M") is None


class TestMemoryStore(StoreContract):
    def make_store(self, tmp_path):
        return MemoryStore()


class DurableStoreContract(StoreContract):
    """What every store that outlives its process must do; subclasses say where one lives."""

    store_class: type[Store]

    def new_location(self, tmp_path: pathlib.Path) -> str:
        """The ``data_dir`` of a new, empty store (for :func:`open_store`)."""
        raise NotImplementedError

    def assert_two_generations_kept(self, store: Store, where: str) -> None:
        """After :meth:`test_everything_survives_reopen`: "a" keeps generations 3 and 4, "b" its 1."""
        raise NotImplementedError

    def set_schema_version(self, where: str, version: int) -> None:
        raise NotImplementedError

    def make_store(self, tmp_path):
        return open_store(self.new_location(tmp_path))

    def test_everything_survives_reopen(self, tmp_path):
        where = self.new_location(tmp_path)
        store = open_store(where)
        assert isinstance(store, self.store_class) and store.durable
        store.create(AggregationRecord("a", '{"a": 1}', created=3.0))
        store.create(AggregationRecord("b", '{"b": 2}', created=1.0))
        store.create(AggregationRecord("c", '{"c": 3}', created=2.0))
        for n in (1, 2, 3):
            store.save_checkpoint("a", state_at(n))
        store.save_checkpoint("b", state_at(7))
        store.set_state("b", FINALIZED, finished=50.0)
        store.set_state("c", FAILED, reason="out of memory", finished=60.0)
        store.ensure_ledger(LedgerRecord("L", "{}", 1.0))
        expected = store.records()
        store.close()
        store.close()  # a second close does nothing

        store = open_store(where)
        try:
            assert store.records() == expected
            assert [r.aggregation_id for r in expected] == ["b", "c", "a"]
            assert store.get("b") == AggregationRecord("b", '{"b": 2}', FINALIZED, 1.0, 50.0, "")
            assert store.get("c") == AggregationRecord("c", '{"c": 3}', FAILED, 2.0, 60.0, "out of memory")
            assert store.load_checkpoint("a") == state_at(3)
            assert store.load_checkpoint("b") == state_at(7)
            assert store.load_checkpoint("c") is None
            assert store.ledgers() == [LedgerRecord("L", "{}", 1.0)]
            store.save_checkpoint("a", state_at(4))  # generations go on after a reopen
            assert store.load_checkpoint("a") == state_at(4)
            self.assert_two_generations_kept(store, where)
        finally:
            store.close()

    def test_newer_schema_is_refused(self, tmp_path):
        where = self.new_location(tmp_path)
        open_store(where).close()
        self.set_schema_version(where, 99)
        with pytest.raises(RuntimeError, match="schema version 99"):
            open_store(where)


def _checkpoint_files(data_dir: pathlib.Path) -> dict[str, list[str]]:
    """``states/`` as {directory name: sorted file names}."""
    states = data_dir / "states"
    return {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(states.iterdir())}


def _only_dir(data_dir: pathlib.Path) -> pathlib.Path:
    (directory,) = (data_dir / "states").iterdir()
    return directory


def _only_dir_name(store: SQLiteStore, aggregation_id: str) -> str:
    """The state directory name of an aggregation (its surrogate key), read from the database."""
    with sqlite3.connect(os.path.join(store.data_dir, "clipd.sqlite3")) as conn:
        (key,) = conn.execute("SELECT key FROM aggregations WHERE id = ?", (aggregation_id,)).fetchone()
    return str(key)


class TestSQLiteStore(DurableStoreContract):
    store_class = SQLiteStore

    def new_location(self, tmp_path):
        return str(tmp_path / "data")

    def assert_two_generations_kept(self, store, where):
        assert _checkpoint_files(pathlib.Path(where))[_only_dir_name(store, "a")] == ["3.state", "4.state"]

    def set_schema_version(self, where, version):
        with sqlite3.connect(os.path.join(where, "clipd.sqlite3")) as conn:
            conn.execute(f"PRAGMA user_version = {version}")

    def test_a_release_survives_reopening_and_a_release_file_without_its_row_is_swept(self, tmp_path):
        data = tmp_path / "data"
        store = SQLiteStore(str(data))
        store.ensure_ledger(LedgerRecord("L", "{}"))
        for aggregation_id in ("kept", "crashed"):
            store.create(AggregationRecord(aggregation_id, "{}"))
            store.save_checkpoint(aggregation_id, state_at(2))
        store.commit_release("kept", b"noised", "L", LedgerEntry("kept", "{}", 0.0, 1.0), 0, finished=1.0)
        crashed = data / "states" / _only_dir_name(store, "crashed")
        (crashed / "release").write_bytes(b"written, then the process died before its commit")
        store.close()
        store = SQLiteStore(str(data))
        try:
            assert store.load_release("kept") == b"noised" and store.get("kept").state == FINALIZED
            assert not (crashed / "release").exists()  # no row: swept at open
            assert store.load_release("crashed") is None and store.load_checkpoint("crashed") == state_at(2)
            assert len(store.ledger_entries("L")) == 1
        finally:
            store.close()

    def test_a_small_release_is_kept_in_its_row_a_large_one_in_a_file_and_older_ones_stay_readable(
            self, tmp_path, monkeypatch):
        """A release of up to 1 MiB (a DP-SGD step's) commits in its row: no file, no fsync of one; a larger one is
        a file made durable before its row. A release a store of schema 6 wrote (a file, the row without its
        blob) reads back after the upgrade."""
        from clipd.server.stores import sqlite as sqlite_store

        data = tmp_path / "data"
        store = SQLiteStore(str(data))
        large = bytes(range(256)) * ((1 << 20) // 256 + 1)
        store.ensure_ledger(LedgerRecord("L", "{}"))
        for position, (aggregation_id, release) in enumerate((("small", b"noised"), ("large", large))):
            store.create(AggregationRecord(aggregation_id, "{}"))
            store.commit_release(aggregation_id, release, "L", LedgerEntry(aggregation_id, "{}", 0.0, 1.0), position,
                                 finished=1.0)
        monkeypatch.setattr(sqlite_store, "INLINE_RELEASE_BYTES", 0)  # as schema 6 wrote every release
        store.create(AggregationRecord("older", "{}"))
        store.commit_release("older", b"as before", "L", LedgerEntry("older", "{}", 0.0, 1.0), 2, finished=1.0)
        files = {aggregation_id: sorted(p.name for p in (data / "states").rglob("release")
                                        if p.parent.name == _only_dir_name(store, aggregation_id))
                 for aggregation_id in ("large", "older")}
        assert not (data / "states" / _only_dir_name(store, "small")).exists()  # not even its directory
        store.close()
        store = SQLiteStore(str(data))  # (the sweep at open keeps the files their rows point at)
        try:
            assert files == {"large": ["release"], "older": ["release"]}
            assert store.load_release("small") == b"noised" and store.load_release("large") == large
            assert store.load_release("older") == b"as before"
            with sqlite3.connect(data / "clipd.sqlite3") as conn:
                inline = dict(conn.execute("SELECT a.id, r.blob IS NOT NULL FROM releases r JOIN aggregations a"
                                           " ON a.key = r.aggregation").fetchall())
            assert inline == {"small": 1, "large": 0, "older": 0}
        finally:
            store.close()

    def test_layout_and_settings(self, tmp_path):
        data = tmp_path / "new" / "data"
        store = SQLiteStore(str(data))
        try:
            assert (data.stat().st_mode & 0o777) & ~0o700 == 0
            assert store.durable
            with sqlite3.connect(data / "clipd.sqlite3") as conn:
                assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
                assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        finally:
            store.close()

    def test_a_version_2_store_opens_with_its_checkpoints_as_shard_0(self, tmp_path):
        """Upgrade in place: a store written before shards keeps its checkpoints (they become shard 0)."""
        from clipd.server.stores import sqlite as sqlite_store

        data = tmp_path / "data"
        (data / "states" / "1").mkdir(parents=True)
        blob = state_at(4).to_bytes()
        (data / "states" / "1" / "1.state").write_bytes(blob)
        with sqlite3.connect(data / "clipd.sqlite3") as conn:
            for statement in (*sqlite_store._SCHEMA, *sqlite_store._SCHEMA_V2):
                conn.execute(statement)
            conn.execute("INSERT INTO aggregations (id, spec, state, created) VALUES ('old', '{}', 'open', 1.0)")
            conn.execute("INSERT INTO checkpoints VALUES (1, 1, '1.state', ?, ?)", (len(blob), zlib.crc32(blob)))
            conn.execute("PRAGMA user_version = 2")
        store = SQLiteStore(str(data))
        try:
            assert store.load_checkpoint("old") == state_at(4)
            assert store.claim_shard("old", 0) == 1
            store.save_checkpoint("old", state_at(5), shard=1)
            assert store.load_checkpoint("old", shard=1) == state_at(5)
        finally:
            store.close()
        with sqlite3.connect(data / "clipd.sqlite3") as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7

    def test_only_two_generations_are_kept(self, tmp_path):
        data = tmp_path / "data"
        store = SQLiteStore(str(data))
        try:
            store.create(record("a"))
            for n in range(1, 6):
                store.save_checkpoint("a", state_at(n))
            assert sorted(p.name for p in _only_dir(data).iterdir()) == ["4.state", "5.state"]
            assert store.load_checkpoint("a") == state_at(5)
        finally:
            store.close()

    def test_unknown_id_writes_no_file(self, tmp_path):
        data = tmp_path / "data"
        store = SQLiteStore(str(data))
        try:
            with pytest.raises(KeyError):
                store.save_checkpoint("ghost", state_at(1))
            assert _checkpoint_files(data) == {}
        finally:
            store.close()

    def test_delete_removes_files(self, tmp_path):
        data = tmp_path / "data"
        store = SQLiteStore(str(data))
        try:
            store.create(record("a"))
            store.create(record("b"))
            store.save_checkpoint("a", state_at(1))
            store.save_checkpoint("a", state_at(2))
            store.save_checkpoint("b", state_at(3))
            assert len(_checkpoint_files(data)) == 2
            store.delete("a")
            assert list(_checkpoint_files(data).values()) == [["1.state"]]
        finally:
            store.close()

    # Damaged checkpoints: the previous generation, with a warning -----------------------
    @staticmethod
    def _two_generations(data: pathlib.Path) -> tuple[SQLiteStore, pathlib.Path]:
        store = SQLiteStore(str(data))
        store.create(record("agg-7"))
        store.save_checkpoint("agg-7", state_at(1))
        store.save_checkpoint("agg-7", state_at(2))
        return store, _only_dir(data) / "2.state"

    @staticmethod
    def _truncate(path: pathlib.Path) -> None:
        path.write_bytes(path.read_bytes()[:-10])

    @staticmethod
    def _flip_byte(path: pathlib.Path) -> None:
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0x01
        path.write_bytes(bytes(blob))

    @pytest.mark.parametrize("damage", ["truncate", "flip_byte", "unlink"])
    def test_damaged_newest_falls_back_to_previous(self, tmp_path, caplog, damage):
        store, newest = self._two_generations(tmp_path / "data")
        try:
            {"truncate": self._truncate, "flip_byte": self._flip_byte, "unlink": pathlib.Path.unlink}[damage](
                newest)
            with caplog.at_level(logging.WARNING, logger="clipd.server.stores.sqlite"):
                loaded = store.load_checkpoint("agg-7")
            assert loaded == state_at(1)
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1
            assert "agg-7" in warnings[0] and "generation 2" in warnings[0]
        finally:
            store.close()

    def test_newest_only_never_returns_an_older_state(self, tmp_path):
        store, newest = self._two_generations(tmp_path / "data")
        try:
            assert store.load_checkpoint("agg-7", newest_only=True) == state_at(2)
            self._flip_byte(newest)
            assert store.load_checkpoint("agg-7", newest_only=True) is None  # a final result: none, not older
            assert store.load_checkpoint("agg-7") == state_at(1)
        finally:
            store.close()

    def test_one_process_per_data_directory(self, tmp_path):
        data = str(tmp_path / "data")
        first = SQLiteStore(data)
        with pytest.raises(RuntimeError, match="in use by another clipd process"):
            SQLiteStore(data)
        probe = subprocess.run(
            [sys.executable, "-c", f"from clipd.server.stores.sqlite import SQLiteStore; SQLiteStore({data!r})"],
            capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and "in use by another clipd process" in probe.stderr
        first.close()
        SQLiteStore(data).close()  # free again once closed

    def test_blob_checksum_is_checked_even_when_the_row_agrees(self, tmp_path, caplog):
        """A blob damaged before its row was written (size and CRC match the row) is still caught."""
        data = tmp_path / "data"
        store, newest = self._two_generations(data)
        store.close()
        self._flip_byte(newest)
        blob = newest.read_bytes()
        with sqlite3.connect(data / "clipd.sqlite3") as conn:
            conn.execute("UPDATE checkpoints SET crc32 = ? WHERE generation = 2", (zlib.crc32(blob),))
        store = SQLiteStore(str(data))
        try:
            with caplog.at_level(logging.WARNING, logger="clipd.server.stores.sqlite"):
                assert store.load_checkpoint("agg-7") == state_at(1)
            assert any("checksum" in r.getMessage() for r in caplog.records)
        finally:
            store.close()

    def test_both_damaged_gives_none(self, tmp_path, caplog):
        store, newest = self._two_generations(tmp_path / "data")
        try:
            self._flip_byte(newest)
            self._truncate(newest.with_name("1.state"))
            with caplog.at_level(logging.WARNING, logger="clipd.server.stores.sqlite"):
                assert store.load_checkpoint("agg-7") is None
            messages = " | ".join(r.getMessage() for r in caplog.records)
            assert "generation 2" in messages and "generation 1" in messages
        finally:
            store.close()

    def test_no_sweep_while_shard_processes_of_an_earlier_owner_run(self, tmp_path, monkeypatch):
        """A sibling (shard process) holds the sweep lock shared: a new owner waits for it before sweeping."""
        from clipd.server.stores import sqlite

        data = tmp_path / "data"
        store = SQLiteStore(str(data))
        store.create(record("a"))
        store.save_checkpoint("a", state_at(1))
        store.close()
        sibling = SQLiteStore(str(data), sibling=True)  # an earlier owner's shard process, still running
        in_flight = _only_dir(data) / "0-feedfacefeedface.state"  # renamed, its row not committed yet
        in_flight.write_bytes(state_at(2).to_bytes())
        refused = []  # the store's lock attempts that a held lock turned away

        class CountedFcntl:  # the store module's fcntl, its refusals counted
            def __getattr__(self, name):
                return getattr(fcntl, name)

            @staticmethod
            def flock(fd, operation):
                try:
                    return fcntl.flock(fd, operation)
                except BlockingIOError:
                    refused.append(operation)
                    raise

        monkeypatch.setattr(sqlite, "fcntl", CountedFcntl())
        opened = []
        opener = threading.Thread(target=lambda: opened.append(SQLiteStore(str(data))))
        opener.start()
        # Turned away by the sibling's lock, and trying again: the new owner waits.
        wait_until(lambda: len(refused) >= 2, 10, "the new owner waiting for the sweep lock")
        assert not opened and in_flight.exists()  # the new owner waits; the file is not swept meanwhile
        sibling.close()  # the shard process exits
        opener.join(10)
        try:
            assert opened and not in_flight.exists()  # now swept (it never got its row)
            assert opened[0].load_checkpoint("a") == state_at(1)
        finally:
            opened[0].close()

    def test_open_sweeps_crash_leftovers(self, tmp_path):
        data = tmp_path / "data"
        store = SQLiteStore(str(data))
        store.create(record("a"))
        store.save_checkpoint("a", state_at(1))
        store.close()
        directory = _only_dir(data)
        (directory / "2.state.tmp").write_bytes(b"half a blob")  # crash mid-write
        (directory / "2.state").write_bytes(state_at(2).to_bytes())  # crash after rename, before commit
        orphan_dir = data / "states" / "999"  # an aggregation whose rows were deleted
        orphan_dir.mkdir()
        (orphan_dir / "1.state").write_bytes(state_at(3).to_bytes())
        (orphan_dir / "1.state.tmp").write_bytes(b"")
        (data / "states" / "notes").mkdir()  # not the store's: left alone

        store = SQLiteStore(str(data))
        try:
            assert _checkpoint_files(data) == {directory.name: ["1.state"], "notes": []}
            assert store.load_checkpoint("a") == state_at(1)
            store.save_checkpoint("a", state_at(4))  # generation 2 again, now committed
            assert store.load_checkpoint("a") == state_at(4)
        finally:
            store.close()

    def test_same_aggregation_from_many_threads(self, tmp_path):
        data = tmp_path / "data"
        store = SQLiteStore(str(data))
        try:
            store.create(record("a"))
            saved = [state_at(n) for n in range(1, 13)]
            workers = [threading.Thread(target=lambda k=k: [store.save_checkpoint("a", s) for s in saved[k::3]])
                       for k in range(3)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(timeout=30)
            assert any(store.load_checkpoint("a") == s for s in saved)
            assert sorted(p.name for p in _only_dir(data).iterdir()) == ["11.state", "12.state"]
        finally:
            store.close()

    # A writer killed with SIGKILL ---------------------------------------------------------
    def test_sigkill_mid_save_loses_nothing_committed(self, tmp_path):
        data = tmp_path / "data"
        child = "\n".join([
            "from __future__ import annotations",
            "import sys",
            "import numpy as np",
            "from clipd.engine import NUM_BUCKETS, LayerSpec, PartialState",
            "from clipd.server.stores.sqlite import SQLiteStore",
            "from clipd.server.stores.base import AggregationRecord",
            inspect.getsource(state_at),
            "store = SQLiteStore(sys.argv[1])",
            "store.create(AggregationRecord('agg', '{}'))",
            "loaded = store.load_checkpoint('agg')",
            "n = 0 if loaded is None else loaded.examples",
            "print('ready', n, flush=True)",
            "while True:",
            "    n += 1",
            "    store.save_checkpoint('agg', state_at(n))",
            "    print(n, flush=True)",
        ])
        rng = random.Random()
        seed = rng.randrange(1 << 30)
        rng.seed(seed)
        committed = 0  # the newest generation a child reported as saved
        for round_ in range(5):
            proc = subprocess.Popen([sys.executable, "-c", child, str(data)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            lines: list[str] = []
            ready = threading.Event()

            def read(stream=proc.stdout, lines=lines, ready=ready) -> None:
                try:
                    for line in stream:
                        lines.append(line.strip())
                        ready.set()
                finally:
                    ready.set()  # the child died before its first line: fail fast

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            try:
                assert ready.wait(30) and proc.poll() is None, f"the child died: {proc.stderr.read()}"
                time.sleep(rng.uniform(0.05, 0.3))
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                reader.join(10)
            stderr = proc.stderr.read()
            proc.stderr.close()
            proc.stdout.close()
            assert proc.returncode == -signal.SIGKILL, stderr
            context = f"seed {seed}, round {round_}, child said {lines[:1]} ... {lines[-1:]}"
            assert lines[0] == f"ready {committed}", context  # the child resumed from the last commit
            printed = [int(x) for x in lines[1:]]
            assert printed == list(range(committed + 1, committed + 1 + len(printed))), context
            last_printed = printed[-1] if printed else committed

            store = SQLiteStore(str(data))
            try:
                loaded = store.load_checkpoint("agg")
            finally:
                store.close()
            assert (loaded is None) == (last_printed == 0), context
            if loaded is not None:
                # Returned saves are durable; at most one more committed before its print.
                assert last_printed <= loaded.examples <= last_printed + 1, context
                assert loaded == state_at(loaded.examples), context
                committed = loaded.examples
        assert committed > 0, f"seed {seed}: no save completed in 5 rounds"
        assert len(list(_only_dir(data).iterdir())) <= 2


def large_state(parameters: int, seed: int) -> PartialState:
    """Odd-sized layers (no multiple of a disk block), values no lossy round trip keeps."""
    rng = np.random.default_rng(seed)
    layers = (LayerSpec("w", (parameters - 1001,)), LayerSpec("b", (1001,)))
    return PartialState.empty(layers).absorb_totals(
        sums=[rng.normal(size=(parameters - 1001,)) / 3.0, rng.normal(size=(1001,))], examples=seed,
        clients={"silo": (seed, "w")}, batches=seed, nbytes=4 * parameters)


def test_a_large_checkpoint_goes_to_disk_with_o_direct_and_reads_back_bit_for_bit(tmp_path, monkeypatch):
    from clipd.engine import _container
    from clipd.server.stores import sqlite

    monkeypatch.setattr(sqlite, "DIRECT_MIN_BYTES", 1 << 20)  # 1 MiB: this state's 1.6 MB is "large"
    monkeypatch.setattr(_container, "_IO_PIECE", 64 << 10)  # and its CRC runs on a thread beside the writes
    direct = []

    class Seen(sqlite._DirectWriter):  # the real writer, counted
        def close(self):
            direct.append(self.size)
            super().close()

    monkeypatch.setattr(sqlite, "_DirectWriter", Seen)
    store = SQLiteStore(str(tmp_path / "data"))
    try:
        assert sqlite._direct_io_works(str(tmp_path)), "this file system takes O_DIRECT (ext4, xfs, btrfs do)"
        store.create(record("a"))
        for seed in (1, 2, 3):
            store.save_checkpoint("a", large_state(200_003, seed))
        assert len(direct) == 3 and direct[0] % 4096  # the last block was padded, then cut off
        assert store.load_checkpoint("a") == large_state(200_003, 3)
        directory = tmp_path / "data" / "states" / _only_dir_name(store, "a")
        # The oldest is unlinked after the acknowledgement, on a thread.
        wait_until(lambda: len(list(directory.glob("*.state"))) <= 2, 10, "the oldest generation unlinked")
        files = sorted(directory.glob("*.state"))
        assert [f.name for f in files] == ["2.state", "3.state"] and files[-1].stat().st_size == direct[-1]
    finally:
        store.close()
    reopened = SQLiteStore(str(tmp_path / "data"))
    try:
        assert reopened.load_checkpoint("a") == large_state(200_003, 3)
    finally:
        reopened.close()

