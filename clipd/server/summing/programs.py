"""The step programs of an aggregation on a device, and the programs this process has already compiled.

A device worker compiles an aggregation's programs once while it warms up (a few bucket sizes of padded batches,
so a step never recompiles); an aggregation whose every program was compiled before (a DP-SGD trainer makes one
aggregation per step, all alike) opens at once.
"""

from __future__ import annotations

import threading

import jax

from clipd.server.aggregations import Aggregation


def bucket_sizes(device_rows: int) -> list[int]:
    """The padded batch sizes compiled for an aggregation: 1, 4, 16, ..., and ``device_rows``.

    Powers of 4, not 2: each size costs about a second of compilation on these
    CPUs, and under load the worker fills whole ``device_rows`` steps anyway.
    """
    return sorted({4**i for i in range(16) if 4**i < device_rows} | {device_rows})


# The (device, program) pairs already compiled in this process: an aggregation whose every
# bucket is here opens at once (a DP-SGD trainer creates one aggregation per step, all alike).
_warm_programs: set[tuple] = set()
_warm_lock = threading.Lock()


def sums_on_host(aggregation: Aggregation, device) -> bool:
    """Whether the shard's steps on ``device`` measure examples and the worker adds them into the host totals
    itself (:meth:`Aggregation.sums_on_host`)."""
    return aggregation.sums_on_host(device.platform)


def programs(aggregation: Aggregation, device) -> list[tuple[int, str]]:
    """The ``(rows, kind)`` steps an aggregation runs (``kind`` as in ``ClipAccumulator.program_key``): every
    bucket size; with one example a step (a large model), on the CPU a step that measures it
    (:func:`sums_on_host`), elsewhere a step whose delta was flushed is not zeroed first: it writes over it
    (``fresh``)."""
    if sums_on_host(aggregation, device):
        return [(1, "measure")]
    buckets = bucket_sizes(aggregation.device_rows)
    return [(b, "sum") for b in buckets] + ([(1, "fresh")] if aggregation.device_rows == 1 else [])


def program_keys(aggregation: Aggregation, device) -> list[tuple]:
    return [(device.platform, device.id, aggregation.weighted, aggregation.accumulator.program_key(rows, kind))
            for rows, kind in programs(aggregation, device)]


def bucket_for(rows: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= rows)


def step_programs(rows: int, buckets: list[int]) -> list[tuple[int, int]]:
    """The programs that sum a step of ``rows`` rows, as ``(start, bucket)``: each reads ``bucket`` rows from
    row ``start`` (the rows past ``rows`` are padding, masked out). One program of the smallest bucket that holds
    them; or, when the bucket below holds at least half of them and is at most a quarter of that one, two
    programs of the bucket below. A step reads each of its bucket's rows, so one a little over a power of 4
    reads about four times its rows (a DP-SGD step of 270 rows: 1,024, where 256 twice read 512 and take a third
    of the time). Both programs are of a size the smaller steps use already: a split never compiles a program
    of its own (the remainder in a bucket of its size, 16 rows here, would read fewer rows, but each new size
    costs a compilation at its first use, longer than it saves in a short training).

    >>> buckets = [1, 4, 16, 64, 256, 1024]
    >>> step_programs(270, buckets), step_programs(250, buckets), step_programs(600, buckets)
    ([(0, 256), (256, 256)], [(0, 256)], [(0, 1024)])
    >>> step_programs(300, [1, 4, 16, 64, 256, 512])  # (512 is twice 256: the split reads as many rows)
    [(0, 512)]
    """
    bucket = bucket_for(rows, buckets)
    below = [b for b in buckets if 4 * b <= bucket]
    if below and rows <= 2 * below[-1]:
        return [(0, below[-1]), (below[-1], below[-1])]
    return [(0, bucket)]


def already_compiled(aggregation: Aggregation, device) -> bool:
    """Whether every step program of ``aggregation`` on ``device`` was compiled in this process already."""
    with _warm_lock:
        return _warm_programs.issuperset(program_keys(aggregation, device))


def compile_programs(aggregation: Aggregation, device, still_wanted=lambda: True) -> bool:
    """Compiles, from shapes alone (``ClipAccumulator.compile``: no batch is made or run), every step program of
    ``aggregation`` on ``device`` not compiled in this process yet; False if ``still_wanted()`` turned false on
    the way (the aggregation went)."""
    acc = aggregation.accumulator
    compiled = already_compiled(aggregation, device)
    with jax.default_device(device):
        for rows, kind in [] if compiled else programs(aggregation, device):
            if not still_wanted():
                return False
            acc.compile(rows, kind, aggregation.weighted)  # (its steps' own programs)
    with _warm_lock:
        _warm_programs.update(program_keys(aggregation, device))
    return True
