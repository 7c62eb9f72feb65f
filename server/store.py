"""Where aggregations outlive the process: their specs, lifecycle and checkpointed partial states.

A checkpoint is a :class:`~clipd.engine.PartialState`: the float64/int64 totals
and, for each client, the highest sequence number they hold. The client marks
live inside the checkpointed blob, never beside it, so a store that falls back
to an older checkpoint (the newest is corrupt) can never pair old sums with
newer sequence numbers.

Implementations:
- :class:`MemoryStore`: in this process only (``data_dir = "memory"``): nothing
  survives a restart. For benchmarks and for callers that do not want disk.
- :class:`clipd.server.sqlite_store.SQLiteStore`: one machine, crash-safe.

Every implementation passes the abstract tests in ``tests/test_store.py``.
"""

from __future__ import annotations

import abc
import dataclasses
import threading

from clipd.engine import PartialState

OPEN, FINALIZED, FAILED = "open", "finalized", "failed"
STATES = (OPEN, FINALIZED, FAILED)


@dataclasses.dataclass(frozen=True)
class AggregationRecord:
    """What the store knows of one aggregation besides its checkpoints."""

    aggregation_id: str
    spec: str  # JSON: layers and policy (see codec.spec_to_json); opaque to the store
    state: str = OPEN  # one of STATES
    created: float = 0.0  # unix seconds
    finished: float | None = None  # unix seconds it was finalized or failed
    reason: str = ""  # why it failed


class Store(abc.ABC):
    """The durable half of the server. Every method is thread-safe; every write is durable on return."""

    durable: bool = True  # False for MemoryStore: nothing survives the process

    @abc.abstractmethod
    def create(self, record: AggregationRecord) -> bool:
        """Adds an aggregation; False (and nothing changes) if its id exists."""

    @abc.abstractmethod
    def records(self) -> list[AggregationRecord]:
        """Every aggregation, oldest first."""

    @abc.abstractmethod
    def get(self, aggregation_id: str) -> AggregationRecord | None: ...

    @abc.abstractmethod
    def set_state(self, aggregation_id: str, state: str, *, reason: str = "",
                  finished: float | None = None) -> None:
        """Moves an aggregation to ``state`` (``KeyError`` if it does not exist)."""

    @abc.abstractmethod
    def save_checkpoint(self, aggregation_id: str, partial: PartialState, *,
                        finished: float | None = None) -> None:
        """Commits ``partial`` as the aggregation's newest checkpoint.

        With ``finished``, the same commit also marks the aggregation FINALIZED
        at that time: the final state and the state change are one transaction.
        ``KeyError`` if the aggregation does not exist.
        """

    @abc.abstractmethod
    def load_checkpoint(self, aggregation_id: str, *, newest_only: bool = False) -> PartialState | None:
        """The newest checkpoint that reads back intact (an older one if the newest is corrupt), or None.

        ``newest_only``: None rather than an older checkpoint (a finalized result
        must be the final state, never an earlier one).
        """

    @abc.abstractmethod
    def delete(self, aggregation_id: str) -> None:
        """Forgets an aggregation and its checkpoints (no error if it does not exist)."""

    def close(self) -> None:
        """Releases files and connections."""


class MemoryStore(Store):
    """A store in this process's memory: the same contract, minus surviving a restart."""

    durable = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, AggregationRecord] = {}
        self._checkpoints: dict[str, PartialState] = {}

    def create(self, record: AggregationRecord) -> bool:
        with self._lock:
            if record.aggregation_id in self._records:
                return False
            self._records[record.aggregation_id] = record
            return True

    def records(self) -> list[AggregationRecord]:
        with self._lock:
            return sorted(self._records.values(), key=lambda r: r.created)

    def get(self, aggregation_id: str) -> AggregationRecord | None:
        with self._lock:
            return self._records.get(aggregation_id)

    def set_state(self, aggregation_id: str, state: str, *, reason: str = "",
                  finished: float | None = None) -> None:
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        with self._lock:
            record = self._records[aggregation_id]
            self._records[aggregation_id] = dataclasses.replace(record, state=state, reason=reason,
                                                                finished=finished)

    def save_checkpoint(self, aggregation_id: str, partial: PartialState, *,
                        finished: float | None = None) -> None:
        with self._lock:
            record = self._records[aggregation_id]
            self._checkpoints[aggregation_id] = partial
            if finished is not None:
                self._records[aggregation_id] = dataclasses.replace(record, state=FINALIZED, finished=finished)

    def load_checkpoint(self, aggregation_id: str, *, newest_only: bool = False) -> PartialState | None:
        with self._lock:
            return self._checkpoints.get(aggregation_id)

    def delete(self, aggregation_id: str) -> None:
        with self._lock:
            self._records.pop(aggregation_id, None)
            self._checkpoints.pop(aggregation_id, None)


def open_store(data_dir: str) -> Store:
    """``"memory"``: a :class:`MemoryStore`; otherwise a SQLite store in that directory (created if need be)."""
    if data_dir == "memory":
        return MemoryStore()
    from .sqlite_store import SQLiteStore

    return SQLiteStore(data_dir)
