"""What the admin API sees of a running server: a typed facade, and the snapshot of the server's own state.

The admin app (its routers, views and metrics) imports this module and nothing else of the server: it reads
aggregations (their host-side statistics), ledgers, buffered streams and the server's snapshot, and cancels an
aggregation; it never touches a device, a store or the gRPC server. :class:`ServerFacade` is what ``ClipdServer``
hands it.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from clipd.server.aggregations import Aggregation, Stats
from clipd.server.credentials import bearer_token, same
from clipd.server.errors import NotFound
from clipd.server.internal.v1.shard_host_pb2 import Load
from clipd.server.progress import THROUGHPUT_SECONDS
from clipd.server.settings import Settings

__all__ = ["THROUGHPUT_SECONDS", "Aggregation", "Load", "NotFound", "ServerFacade", "ServerSnapshot", "Settings",
           "Stats", "bearer_token", "same"]


@dataclasses.dataclass(frozen=True)
class ServerSnapshot:
    """The server's own state as the admin API shows it, read at one moment (``ClipdServer.snapshot``)."""

    serving: bool
    started_unix_seconds: float  # when this server started
    # Submit streams, buffered bytes and refusals summed over every process that receives: this one, or its shard
    # hosts (the Load message they report, field by field).
    load: Load
    queue_depth: int
    queued_bytes: int
    device_kind: str  # what the devices are ("cpu", a GPU's name)
    devices: list[dict]  # each device at work: id, kind, platform, steps, ...
    # Shard processes or Ray shard hosts, each with the calls it forwarded here and its own load (streams, buffers,
    # refusals: None until its first statistics) and restarts (start-up retries included).
    shard_processes: list[dict]
    payload_bytes_received: int  # Submit payload this process received itself
    shard_payload_bytes: int | None  # ... and, with shard processes or hosts, what they received
    # What `clipd serve` set at start-up (clipd/_process.py): each variable's value and where it came from.
    process_tuning: dict = dataclasses.field(default_factory=dict)

    @property
    def streams_saturated(self) -> bool:
        return self.load.active_streams >= self.load.stream_limit

    @property
    def restarts(self) -> int:
        """Restarts of every shard process or host (0 without them)."""
        return sum(p["restarts"] for p in self.shard_processes)


class ServerFacade(Protocol):
    """The calls the admin API makes on the server (``ClipdServer`` has them)."""

    settings: Settings

    def aggregations(self) -> list[Aggregation]:
        """Every aggregation the server holds (open, finished, failed)."""

    def aggregation(self, aggregation_id: str) -> Aggregation:
        """One aggregation (``NotFound`` if there is none)."""

    def stats(self, aggregation: Aggregation) -> Stats:
        """Its statistics now, from wherever it is summed (this process, or its shard hosts' reports)."""

    def throughput(self, aggregation: Aggregation) -> tuple[list[tuple[int, int]], bool]:
        """Its examples per second, second by second: ``([(unix second, examples), ...], truncated)``."""

    def cancel(self, aggregation_id: str) -> Aggregation:
        """Drops an aggregation (or a finished one's result): what a DELETE does."""

    def snapshot(self) -> ServerSnapshot:
        """The server's own state now."""

    def ledger_ids(self) -> list[str]:
        """Every privacy ledger's id."""

    def ledger(self, ledger_id: str) -> dict | None:
        """A ledger as plain data (``Ledgers.describe``), None if there is none."""

    def buffered_streams(self) -> list[dict]:
        """Every buffered stream as plain data (``BufferedStream.describe``, with its ledger's epsilon)."""
