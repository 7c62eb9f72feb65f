"""How far an aggregation has come: examples, batches and bytes summed, when, how fast, second by second.

One :class:`Progress` is kept wherever an aggregation's numbers are counted: by the aggregation itself (its
device workers' steps, ``Aggregation.record``) and, in the control process of shard hosts, by the control's
read-only view of an aggregation its hosts sum (``shards.hosts.HostedAggregation``, from their reports). It is
not locked: its owner guards it, and hands readers a :class:`Counts` snapshot.

>>> progress = Progress(created=100.0)
>>> progress.count(rows=3, batches=1, nbytes=24, now=100.5)
>>> progress.count_to(examples=10, batches=2, nbytes=80, now=101.2)
>>> progress.throughput()
([(99, 0), (100, 3), (101, 7)], False)
"""

from __future__ import annotations

import collections
import dataclasses
import time

THROUGHPUT_SECONDS = 240  # the throughput series keeps the last 240 seconds in which examples arrived
RATE_SAMPLES = 64  # samples of the examples so far, at least 0.25 s apart: 64 cover >= 16 s
RATE_WINDOW = 10.0  # seconds over which examples_per_second is measured


@dataclasses.dataclass(frozen=True)
class Counts:
    """A :class:`Progress` read at one moment."""

    examples: int
    batches: int
    bytes: int
    updated_unix_seconds: float  # when they last moved (the creation time before)
    examples_per_second: float  # over the last RATE_WINDOW seconds (0 once idle that long)


class Progress:
    """Examples, batches and bytes summed so far; a rate over the last seconds; the throughput series."""

    def __init__(self, created: float, examples: int = 0, batches: int = 0, nbytes: int = 0) -> None:
        self.created = created
        self.examples, self.batches, self.bytes = examples, batches, nbytes
        self.updated = created
        self._rates: collections.deque[tuple[float, int]] = collections.deque(maxlen=RATE_SAMPLES)
        self._rate_base = examples
        # (unix second, examples at its end) of each second in which examples arrived, the last THROUGHPUT_SECONDS
        # of them; and the examples before its first second.
        self._series: collections.deque[tuple[int, int]] = collections.deque(maxlen=THROUGHPUT_SECONDS)
        self._series_base = examples
        self._series_truncated = False  # older seconds dropped out

    def count(self, rows: int, batches: int, nbytes: int, now: float) -> None:
        """``rows`` more examples in ``batches`` batches of ``nbytes`` bytes were summed at ``now`` (unix time)."""
        self.count_to(self.examples + rows, self.batches + batches, self.bytes + nbytes, now)

    def count_to(self, examples: int, batches: int, nbytes: int, now: float) -> None:
        """The totals are now these (a host's report, or a finalize's merged totals)."""
        self.examples, self.batches, self.bytes, self.updated = examples, batches, nbytes, now
        if not self._rates or now - self._rates[-1][0] >= 0.25:
            self._rates.append((now, examples))
        second = int(now)
        if self._series and second <= self._series[-1][0]:  # the same second (or the clock stepped back)
            self._series[-1] = (self._series[-1][0], examples)
        elif examples != (self._series[-1][1] if self._series else self._series_base):
            if len(self._series) == self._series.maxlen:
                self._series_base, self._series_truncated = self._series[0][1], True
            self._series.append((second, examples))

    def rate(self, now: float | None = None) -> float:
        """Examples per second over the last RATE_WINDOW seconds (0 once idle that long)."""
        now = time.time() if now is None else now
        start = max(self.created, now - RATE_WINDOW)
        before = [n for t, n in self._rates if t <= start]
        base = before[-1] if before else self._rate_base
        return (self.examples - base) / (now - start) if now > start else 0.0

    def counts(self) -> Counts:
        return Counts(self.examples, self.batches, self.bytes, self.updated, self.rate())

    def throughput(self) -> tuple[list[tuple[int, int]], bool]:
        """Examples per second, second by second: ``([(unix second, examples summed in it), ...], truncated)``.

        The seconds in which examples arrived (the last THROUGHPUT_SECONDS of them), with a 0 on each side of an
        idle gap, and, unless older seconds dropped out (``truncated``), a 0 the second before the first. The same
        on every read until more examples arrive.
        """
        points: list[tuple[int, int]] = []
        if self._series and not self._series_truncated:
            points.append((self._series[0][0] - 1, 0))
        last_second, last = None, self._series_base
        for second, examples in self._series:
            if last_second is not None and second - last_second > 1:
                points.append((last_second + 1, 0))
                if second - last_second > 2:
                    points.append((second - 1, 0))
            points.append((second, examples - last))
            last_second, last = second, examples
        return points, self._series_truncated
