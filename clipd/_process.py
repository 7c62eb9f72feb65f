"""How a ``clipd serve`` process tunes itself at start-up: glibc's malloc and OpenBLAS's threads.

A server receives updates of many MB into buffers it frees and takes again. glibc serves a request above its
mmap threshold (128 KiB at first, raised by each free up to 32 MiB) with a fresh mapping whose pages the
kernel zeroes on first touch, and gives the top of the heap back past its trim threshold: so by default a
round's buffers are faulted in again and again. clipd sets (unless the environment already does):

- ``M_MMAP_THRESHOLD`` 32 MiB (glibc's ``MALLOC_MMAP_THRESHOLD_``): requests below it come from the heap, whose
  pages stay mapped; larger ones (a large update's receive buffers, which the server pools itself) are
  mapped;
- ``M_TRIM_THRESHOLD`` 1 GiB (``MALLOC_TRIM_THRESHOLD_``): freed heap pages are kept up to that (the server
  trims the heap itself after large releases: ``summing.memory.trim_heap``);
- ``OPENBLAS_NUM_THREADS=1``: numpy's few BLAS calls in a server of many threads don't spawn a pool each.

The malloc settings are made with ``mallopt`` in this process and put in the environment for the processes it
starts (shard processes, the secure sampler's workers), whose glibc reads them at start-up. This module imports
nothing but the standard library: it runs before numpy is imported (OpenBLAS reads its variable then).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
SETTINGS = {  # environment variable: (mallopt parameter, value); None: not a malloc setting
    "MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, 32 << 20),
    "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, 1 << 30),
    "OPENBLAS_NUM_THREADS": (None, 1),
}
TUNED: dict[str, dict] = {}  # what :func:`tune` applied in this process (empty: not a server process)


def tune() -> dict[str, dict]:
    """Applies :data:`SETTINGS` to this process (a variable already in the environment wins: its value is the
    one glibc or OpenBLAS read) and to its children; what each one is, and where it came from:
    ``environment``, ``mallopt`` (set here), ``children only`` (mallopt refused: not glibc)."""
    applied: dict[str, dict] = {}
    mallopt = _mallopt()
    for name, (parameter, default) in SETTINGS.items():
        given = os.environ.get(name)
        if given is not None:
            applied[name] = {"value": given, "source": "environment"}
            continue
        os.environ[name] = str(default)
        if parameter is None:
            source = "environment"  # set before numpy (and OpenBLAS) loads
        else:
            source = "mallopt" if mallopt is not None and mallopt(parameter, default) == 1 else "children only"
        applied[name] = {"value": str(default), "source": source}
    TUNED.update(applied)
    return applied


def _mallopt():
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl has no mallopt)
        return None
    function.argtypes, function.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return function

