"""Work that runs beside the tests: slow subprocess runs that only wait and check their output (the benchmark
smoke runs, NVFlare's simulator jobs) start once collection is done, one at a time, on a thread of their own.

The suite is mostly one process on one core: on two cores these runs use the other one instead of holding the
suite up when their tests come. A test waits for its job's result (``Job.result``), and runs the job itself if no
thread has started it yet. A test module declares its jobs with a module-level function
``background_jobs(items, config) -> list[Job]`` (``items``: the module's selected tests), which conftest calls;
at the end of the session, a job still running has its processes killed and its cleanups run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable
from typing import Any

_LOCK = threading.Lock()
_JOBS: dict[str, Job] = {}
_KILLS: dict[int, Callable[[], None]] = {}  # how to kill each process the jobs run now (by id of its Popen)
_CLEANUPS: list[Callable[[], None]] = []
_ENDED = threading.Event()  # the session has ended: a job starts no new process
NICENESS = 10  # of the jobs' processes (and so of theirs): the tests' own processes come first on a busy machine


class Job:
    """``fn()`` run once, by the first of a background thread or a waiting test to take it up."""

    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        self.name, self.fn = name, fn
        self._taken = False
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def take(self) -> bool:
        """Runs the job here if nobody has taken it yet; True if this call ran it."""
        with _LOCK:
            if self._taken:
                return False
            self._taken = True
        try:
            self._value = self.fn()
        except BaseException as e:  # (re-raised in the test that waits for it)
            self._error = e
        finally:
            self._done.set()
        return True

    def result(self) -> Any:
        """The job's value (its exception raised here), once it has run; runs it now if nobody has started it."""
        self.take()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


def register(jobs: Iterable[Job]) -> list[Job]:
    """Adds ``jobs`` under their names (a name already there keeps its job); returns the registered jobs."""
    with _LOCK:
        return [_JOBS.setdefault(job.name, job) for job in jobs]


def job(name: str, make: Callable[[], Job]) -> Job:
    """The job registered as ``name``, or ``make()``'s, registered now (a module run without the conftest hook)."""
    with _LOCK:
        found = _JOBS.get(name)
    return found if found is not None else register([make()])[0]


def run_in_thread(jobs: Iterable[Job], name: str) -> threading.Thread:
    """Takes up ``jobs`` in order, one at a time, on a daemon thread (jobs already taken are passed over)."""
    pending = list(jobs)

    def lane() -> None:
        for each in pending:
            each.take()

    thread = threading.Thread(target=lane, name=name, daemon=True)
    thread.start()
    return thread


def run_process(command: list[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout)`` in a process group of its own,
    which the end of the session kills if it is still running, the processes it started with it
    (``TimeoutExpired`` after ``timeout`` s, the group killed)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **popen)
    lower_priority(process)
    with tracked(process):
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def lower_priority(process: subprocess.Popen) -> None:
    """Gives a job's process the niceness NICENESS, before it has started any of its own (they inherit it): on two
    cores the tests run at their own speed while the jobs take what the tests leave."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.setpriority(os.PRIO_PROCESS, process.pid, NICENESS)


@contextlib.contextmanager
def tracked(process: subprocess.Popen, kill: Callable[[], None] | None = None):
    """While inside, the end of the session kills ``process`` (with ``kill()``, else the process, or its process
    group if it leads one). Once the session has ended, it is killed at once and this raises RuntimeError."""

    def default_kill() -> None:
        if process.poll() is None:
            if os.getpgid(process.pid) == process.pid:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()

    with _LOCK:
        _KILLS[id(process)] = kill or default_kill
    try:
        if _ENDED.is_set():
            _kill(_KILLS[id(process)])
            raise RuntimeError("the test session has ended")
        yield process
    finally:
        with _LOCK:
            _KILLS.pop(id(process), None)


def _kill(kill: Callable[[], None]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        kill()


def at_session_end(cleanup: Callable[[], None]) -> None:
    """Runs ``cleanup()`` at the end of the session (after the processes still running are killed); now, if the
    session has already ended."""
    with _LOCK:
        if not _ENDED.is_set():
            _CLEANUPS.append(cleanup)
            return
    cleanup()


def end_session() -> None:
    """Kills what the jobs still run and runs their cleanups; a job starts no process after this."""
    _ENDED.set()
    with _LOCK:
        kills, cleanups = list(_KILLS.values()), list(_CLEANUPS)
        _CLEANUPS.clear()
    for kill in kills:
        _kill(kill)
    for cleanup in cleanups:
        with contextlib.suppress(Exception):
            cleanup()
