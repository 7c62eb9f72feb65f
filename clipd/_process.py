"""How a ``clipd serve`` process tunes itself at start-up: glibc's mmap and trim thresholds, OpenBLAS's threads
(and a DP-SGD trainer's process its malloc: :func:`tune`).

A server receives batches of many KB to MB into buffers it frees and takes again. glibc serves a request above
its mmap threshold (128 KiB at first, raised by frees up to 32 MiB) with a fresh mapping whose pages the kernel
zeroes on first touch: so by default the first batches of every size are faulted in again and again. clipd
sets (unless the environment already does):

- ``M_MMAP_THRESHOLD`` 32 MiB (glibc's ``MALLOC_MMAP_THRESHOLD_``): requests below it come from the heap, whose
  freed pages are reused; larger ones (a large update's receive buffers, which the server pools itself) are
  mapped;
- ``M_TRIM_THRESHOLD`` 8 MiB (``MALLOC_TRIM_THRESHOLD_``): free space at the top of a heap goes back to the system
  once it passes 8 MiB, not 128 KiB (glibc's default, which setting the mmap threshold keeps): at the default, a
  DP-SGD step's request of 2.5 MB, freed at the top of its heap, was returned and faulted in again by the next
  one (a refused 2.5 MB call took 8 ms, against 3 ms);
- ``OPENBLAS_NUM_THREADS=1``: numpy's few BLAS calls in a server of many threads don't spawn a pool each.

Beyond 8 MiB freed heap pages go back to the system (a flood of abandoned half batches leaves the server's
memory where it was: tests/test_abuse_process.py); a 1 GiB trim threshold, as the service benchmark sets, is
faster and keeps them. The malloc settings are made with ``mallopt`` in this process
and put in the environment for the processes it starts (shard processes, the secure sampler's workers), whose
glibc reads it at start-up. This module imports
nothing but the standard library: it runs before numpy is imported (OpenBLAS reads its variable then).

Once it serves, :func:`settle`: the objects of its start-up (numpy's, JAX's, gRPC's modules: about 150,000) are
frozen out of the cyclic garbage collector's reach (``gc.freeze``), and a young generation is collected after
20,000 new objects instead of 700 (:data:`GC_THRESHOLDS`). A round of thousands of one-message clients allocates a few
hundred tracked objects a call, most freed by their reference counts within the call; at Python's default the
collector ran every few calls and re-scanned the calls in flight: 5% of a shard process's CPU in such a round.

Besides, :func:`name_threads`: each thread's name is given to its native thread, so ``top -H``, ``ps -L``
and ``/proc/<pid>/task/<tid>/comm`` say which part of the server spends the CPU (``benchmarks/round.py``
splits it so).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
SETTINGS = {  # environment variable: (mallopt parameter, value); None: not a malloc setting
    "MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, 32 << 20),
    "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, 8 << 20),
    "OPENBLAS_NUM_THREADS": (None, 1),
}
TUNED: dict[str, dict] = {}  # what :func:`tune` applied in this process (empty: not a server process)
GC_THRESHOLDS = (20_000, 20, 20)  # gc.set_threshold once a server process serves (:func:`settle`)


MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def tune(names=tuple(SETTINGS)) -> dict[str, dict]:
    """Applies :data:`SETTINGS` (those of ``names``) to this process (a variable already in the environment wins:
    its value is the one glibc or OpenBLAS read) and to its children; what each one is, and where it came from:
    ``environment``, ``mallopt`` (set here), ``children only`` (mallopt refused: not glibc).

    A DP-SGD trainer applies the malloc settings alone (:data:`MALLOC_SETTINGS`, ``clipd.client.dpsgd.DpSgd``): it
    sends a request of megabytes every few milliseconds, which glibc's defaults map and fault in again each time
    (on a VM, 2 ms of a step's round trip)."""
    applied: dict[str, dict] = {}
    mallopt = _mallopt()
    for name, (parameter, default) in ((n, SETTINGS[n]) for n in names):
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


def settle() -> int:
    """Once the process serves: its start-up objects frozen out of the garbage collector's scans, and its
    generations collected less often (:data:`GC_THRESHOLDS`). Returns how many objects were frozen.

    Cycles made later are still found: only what exists now (modules, compiled programs, the server) is left
    out, and it lives as long as the process."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    frozen = gc.get_freeze_count()
    TUNED["python_gc"] = {"value": ",".join(map(str, GC_THRESHOLDS)), "source": f"gc.freeze ({frozen} objects)"}
    return frozen


def _mallopt():
    return libc_function("mallopt", [ctypes.c_int, ctypes.c_int])  # (None: not glibc; musl has no mallopt)


PR_SET_NAME = 15  # linux/prctl.h: the calling thread's name (15 bytes and a NUL)


def name_threads() -> bool:
    """From now on each Python thread started in this process gives its name (its first 15 bytes, what Linux
    keeps) to its native thread; False where the C library has no ``prctl`` (not Linux): nothing is changed.
    (The main thread keeps the process's name, which the threads native code starts from it inherit.)"""
    prctl = libc_function("prctl", [ctypes.c_int, ctypes.c_char_p])
    if prctl is None:
        return False

    def name(text: str) -> None:
        with contextlib.suppress(Exception):  # (a name is a convenience: never worth a failed thread)
            prctl(PR_SET_NAME, text.encode(errors="replace")[:15])

    start = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap_inner(thread: threading.Thread) -> None:
        name(thread.name)
        start(thread)

    if not getattr(start, "names_native_thread", False):
        bootstrap_inner.names_native_thread = True  # type: ignore[attr-defined]
        threading.Thread._bootstrap_inner = bootstrap_inner  # type: ignore[attr-defined]
    return True


def libc_function(name: str, argtypes):
    """The C library's function ``name`` returning an int, with ``argtypes``; None where it has none."""
    try:  # (the process's own symbols, the C library's among them: find_library would run ldconfig)
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function
