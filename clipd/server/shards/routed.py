"""Shard hosts with buffered streams: a stream's buffers are summed by the control process's own devices.

With ``--processes N`` the shard processes receive, clip and sum every aggregation's batches, and the control
process never sees a payload byte, except a buffered stream's. A stream decides, in the control process, which
buffer each contribution goes into, with what weight, and when each buffer is released (``server.streams``): its
contributions (``SubmitToStream``, one message each) come to the control process like every call but Submit, and
are summed there, on its devices. Its buffers are never opened by a shard process (they refuse them), so
nothing is fenced between the two. :class:`StreamsHere` is the one seam (``Shards``) that routes each
aggregation to where it is summed::

    aggregation.spec.stream ? local Devices (this process) : ShardHosts (the shard processes)
"""

from __future__ import annotations

from clipd.engine import PartialState
from clipd.server.aggregations import Aggregation, Stats
from clipd.server.lifecycle import Shards
from clipd.server.shards.hosts import ShardHosts
from clipd.server.summing.devices import Devices


class StreamsHere(Shards):
    """``hosts`` sum the aggregations, ``local`` (this process's devices) the buffered streams' buffers."""

    def __init__(self, hosts: ShardHosts, local: Devices) -> None:
        self.hosts, self.local = hosts, local

    def _of(self, aggregation: Aggregation) -> Shards:
        return self.local if aggregation.spec.stream else self.hosts

    def __len__(self) -> int:
        return len(self.hosts)

    def endpoints(self) -> list[str]:
        return self.hosts.endpoints()

    def submit(self, aggregation: Aggregation, client: str, writer: str, batch) -> None:
        self._of(aggregation).submit(aggregation, client, writer, batch)

    def sum_in_line(self, aggregation: Aggregation, client: str, writer: str, batch) -> None:
        self.local.sum_in_line(aggregation, client, writer, batch)  # (a DP-SGD step's: summed here, as a buffer)

    def warm_up(self, aggregation: Aggregation) -> None:
        self._of(aggregation).warm_up(aggregation)

    def commit_final(self, aggregation: Aggregation, timeout: float | None = None) -> list[PartialState]:
        return self._of(aggregation).commit_final(aggregation, timeout)

    def forget(self, aggregation: Aggregation) -> None:
        self._of(aggregation).forget(aggregation)

    def finished(self, aggregation: Aggregation) -> None:
        self._of(aggregation).finished(aggregation)

    def stats(self, aggregation: Aggregation) -> Stats:
        return self._of(aggregation).stats(aggregation)

    def throughput(self, aggregation: Aggregation) -> tuple[list[tuple[int, int]], bool]:
        return self._of(aggregation).throughput(aggregation)

    @property
    def ready(self) -> bool:
        return self.hosts.ready and self.local.ready

    @property
    def queued_bytes(self) -> int:
        return self.hosts.queued_bytes + self.local.queued_bytes

    @property
    def queue_depth(self) -> int:
        return self.hosts.queue_depth + self.local.queue_depth

    @property
    def device_kind(self) -> str:
        return self.hosts.device_kind

    def describe(self) -> list[dict]:
        """The hosts' devices, then this process's once they have summed (``"process": "control"``: the streams'
        buffers)."""
        return [*self.hosts.describe(), *({**d, "process": "control"} for d in self.local.describe() if d["steps"])]

    def stop(self, timeout: float | None = None) -> None:
        self.hosts.stop(timeout)
        self.local.stop(timeout)
