"""Ingest processes: ``clipd serve --processes N`` receives and parses on N processes, one port for clients.

Layout (one host)::

    clients --TCP--> port P (SO_REUSEPORT) --> ingest process 1..N --unix socket--> server process
                                                      |                                 (aggregations, devices,
                                                      +--- shared memory (one arena each) store, admin API)

The kernel spreads client connections over the N ingest processes. An ingest
process terminates TLS, receives and parses Submit messages (the work that is
bound to one GIL in a single process), copies each chunk's tensor data into its
shared-memory arena and forwards the message with the data replaced by a
reference (:func:`clipd.server.wire.encode_shared`). The server process reads
the data in place and copies it only into its staging buffer, as it does for
a message it received itself. Every other RPC is forwarded byte for byte,
metadata (the bearer token) included. So sequence numbers, acknowledgements,
auth and limits stay in one place, the server process, and are exactly those
of a single process.

The arena is a ring of regions (:class:`Arena`), each with a 64-byte header:
its state, its size and a random 64-bit tag that the reference carries too.
The ingest process allocates at the head (FREE -> IN_USE) and reclaims from
the tail (FREE regions only). Every other transition is the server process's,
under one lock (:class:`SharedRegions`): reading a region (IN_USE -> READ, only
with the right tag), freeing it when the last view of its data is gone
(READ -> FREE, a ``weakref.finalize`` on the array the views come from: once
the device worker has copied the batch, at once for a batch reassembled from
several chunks or a refused one), and giving back the regions of a call that
ended before the server read them (IN_USE -> FREE: when a Submit call ends,
the ingest process sends their references to the internal ``Release``
method). So no region stays in use for good, and no reference (a stale one, a
forged one) can make the server read a region that holds other data. A full
arena makes the ingest process wait (back-pressure) for up to
``buffer_wait`` seconds, then refuse the batch (RESOURCE_EXHAUSTED).

The server process starts the ingest processes, restarts one that dies, and
they exit when it does (they watch their parent).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import mmap
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref

import grpc
import numpy as np

from clipd.v1 import clipd_pb2

from . import wire
from .errors import ClipdError, InvalidArgument, ResourceExhausted
from .settings import Settings

log = logging.getLogger(__name__)

HEADER = 64  # bytes before each region's data; regions start on 64-byte boundaries
FREE, IN_USE, SKIP, READ = 0, 1, 2, 3  # a region's state: the header's first 8 bytes
_HEAD = struct.Struct("<QQQ")  # state, region size (header included), tag
RELEASE_METHOD = "/clipd.internal.Ingest/Release"  # the server's internal socket only
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault the whole mapping in at once
SEGMENT_NAME = re.compile(r"ingest-[0-9]+-[0-9]+")
INGEST_METADATA = "x-clipd-ingest"  # which ingest process forwarded a call (counted by the server)
SERVICE = clipd_pb2.DESCRIPTOR.services_by_name["Clipd"]


def _round_up(n: int, to: int = HEADER) -> int:
    return -(-n // to) * to


class Arena:
    """The ingest side of one shared-memory segment: a ring of regions, allocated at the head, freed by the server.

    >>> import tempfile
    >>> arena = Arena(tempfile.mkdtemp(), "ingest-0-0", 4 * HEADER)
    >>> a = arena.put(b"x" * 10, wait=0)       # header + 64 bytes
    >>> a[:3], bytes(arena.map[a[1] + HEADER : a[1] + HEADER + 10])
    (('ingest-0-0', 0, 10), b'xxxxxxxxxx')
    >>> arena.put(b"y" * 100, wait=0)          # header + 128: no room until the first is freed
    Traceback (most recent call last):
    ...
    clipd.server.errors.ResourceExhausted: ingest: a chunk of 100 bytes waited 0 s for room in the shared buffer of 256 bytes; retry later
    >>> SharedRegions(arena.directory).release([a])  # never read: given back
    1
    >>> arena.put(b"y" * 100, wait=0)[:3]
    ('ingest-0-0', 0, 100)
    """

    def __init__(self, directory: str, name: str, size: int) -> None:
        if not SEGMENT_NAME.fullmatch(name):
            raise ValueError(f"arena name {name!r}")
        self.name, self.size, self.directory = name, _round_up(size), directory
        self.path = os.path.join(directory, name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
            # Pages allocated and mapped now, at start-up, not one fault at a time under load.
            self.map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        self._head = self._tail = 0  # byte counters; positions are modulo size
        self._lock = threading.Lock()

    def put(self, data, wait: float) -> tuple[str, int, int, int]:
        """Copies ``data`` into a new region: ``(segment, header offset, length, tag)`` for the server to read."""
        length = len(data) if not isinstance(data, memoryview) else data.nbytes
        need = HEADER + _round_up(max(length, 1))
        deadline, pause = time.monotonic() + wait, 0.0002
        with self._lock:
            while not self._reserve(need):
                if need > self.size or time.monotonic() >= deadline:
                    raise ResourceExhausted(
                        f"ingest: a chunk of {length} bytes waited {wait:g} s for room in the shared buffer of"
                        f" {self.size} bytes; retry later", retry_after=0.5)
                self._lock.release()
                try:  # the server frees regions as its device catches up: poll, less often the longer it takes
                    time.sleep(pause)
                    pause = min(2 * pause, 0.01)
                finally:
                    self._lock.acquire()
            at = (self._head - need) % self.size
            self.map[at + HEADER : at + HEADER + length] = data
            tag = secrets.randbits(64)
            _HEAD.pack_into(self.map, at, IN_USE, need, tag)  # the data first: the server reads after this
            return self.name, at, length, tag

    def _reserve(self, need: int) -> bool:
        """Advances the head over a region of ``need`` bytes (and a SKIP to the start first if it does not fit)."""
        self._reclaim()
        if self._tail == self._head:  # empty: start again at the beginning
            self._head = self._tail = 0
        at = self._head % self.size
        skip = self.size - at if at + need > self.size else 0
        if self._head + skip + need - self._tail > self.size:
            return False
        if skip:
            _HEAD.pack_into(self.map, at, SKIP, skip, 0)
            self._head += skip
        _HEAD.pack_into(self.map, self._head % self.size, IN_USE, need, 0)  # tag 0: no reference matches yet
        self._head += need
        return True

    def _reclaim(self) -> None:
        """Moves the tail over regions the server has freed (and wrap markers), oldest first."""
        while self._tail < self._head:
            state, size, _ = _HEAD.unpack_from(self.map, self._tail % self.size)
            if state in (IN_USE, READ):
                return
            self._tail += size

    def unread(self, refs) -> list:
        """The references among ``refs`` whose region the server has not read (nor freed) yet."""
        unread = []
        for ref in refs:
            state, _, tag = _HEAD.unpack_from(self.map, ref[1])
            if state == IN_USE and tag == ref[3]:
                unread.append(ref)
        return unread

    @property
    def used(self) -> int:
        with self._lock:
            self._reclaim()
            return self._head - self._tail

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.map.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _free(mapping, offset: int) -> None:
    """Marks the region at ``offset`` FREE (READ -> FREE: the last view of its data is gone)."""
    struct.pack_into("<Q", mapping, offset, FREE)


class SharedRegions:
    """The server side: maps the ingest processes' segments and hands out views that free their region when gone.

    Every transition of a region's state but the ingest's FREE -> IN_USE happens here, under one lock.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def _map(self, segment: str) -> mmap.mmap:
        """The segment's mapping (caller holds ``_lock``)."""
        mapping = self._maps.get(segment)
        if mapping is None:
            if not SEGMENT_NAME.fullmatch(segment):
                raise ValueError(f"shared chunk: no segment {segment!r}")
            with open(os.path.join(self.directory, segment), "r+b") as f:
                mapping = self._maps[segment] = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | _POPULATE)
        return mapping

    def open(self, segment: str) -> None:
        """Maps a new ingest process's segment now (at its start), rather than at its first batch."""
        with self._lock:
            self._map(segment)

    def _region(self, segment: str, offset: int, length: int, tag: int):
        """The mapping if the reference names a region IN_USE with this tag (caller holds ``_lock``), else None."""
        mapping = self._map(segment)
        if offset % HEADER or offset + HEADER + length > len(mapping):
            raise ValueError(f"shared chunk: region {offset}+{length} is outside segment {segment!r}")
        state, size, current = _HEAD.unpack_from(mapping, offset)
        return mapping if state == IN_USE and current == tag and size >= HEADER + length else None

    def view(self, segment: str, offset: int, length: int, tag: int) -> memoryview:
        """The data of a region (IN_USE -> READ); it is FREE again once this view and every view of it are gone."""
        with self._lock:
            mapping = self._region(segment, offset, length, tag)
            if mapping is None:
                raise ValueError(f"shared chunk: region {offset} of {segment!r} is not in use by this reference")
            struct.pack_into("<Q", mapping, offset, READ)
        data = np.frombuffer(mapping, np.uint8, count=length, offset=offset + HEADER)
        weakref.finalize(data, _free, mapping, offset)
        return memoryview(data)

    def release(self, refs) -> int:
        """Frees the regions of ``(segment, offset, length, tag)`` references never read (IN_USE -> FREE); how many."""
        freed = 0
        with self._lock:
            for segment, offset, length, tag in refs:
                with contextlib.suppress(ValueError, OSError):  # a gone segment, a bad reference: nothing to do
                    mapping = self._region(segment, offset, length, tag)
                    if mapping is not None:
                        struct.pack_into("<Q", mapping, offset, FREE)
                        freed += 1
        return freed

    def forget(self, prefix: str) -> None:
        """Drops the mappings of a dead ingest process's segments (views still alive keep theirs)."""
        with self._lock:
            for segment in [s for s in self._maps if s.startswith(prefix)]:
                del self._maps[segment]


class _CallEnded(Exception):
    """The Submit call is over: its request stream puts nothing more in the arena."""


class _CallRegions:
    """The regions one Submit call put in the arena; once the call ends, the ones the server never read.

    ``put`` (gRPC's request thread) and ``close`` (the handler, when the call
    ends) take one lock, so no region can be put after the call's unread ones
    were counted: it would be IN_USE for good, and the ring stuck behind it.
    """

    def __init__(self, arena: Arena | None) -> None:
        self.arena, self.refs, self.closed = arena, [], False
        self._lock = threading.Lock()

    def put(self, data, wait: float) -> tuple[str, int, int, int]:
        with self._lock:
            if self.closed:
                raise _CallEnded()
            self.refs.append(self.arena.put(data, wait))
            return self.refs[-1]

    def close(self) -> list:
        """Ends the call's puts; the references whose region the server never read."""
        with self._lock:
            self.closed = True
            return self.arena.unread(self.refs) if self.arena is not None and self.refs else []


# The ingest process -------------------------------------------------------------------------
def _forwarded_metadata(context, index: int) -> list[tuple[str, str]]:
    """The caller's metadata (its bearer token), and which ingest process forwards it (the caller's own dropped)."""
    keep = [(k, v) for k, v in context.invocation_metadata()
            if not k.startswith((":", "grpc-")) and k not in ("user-agent", INGEST_METADATA)]
    return [*keep, (INGEST_METADATA, str(index))]


def _relay(context, error: grpc.RpcError) -> None:
    """Ends the client's call with the server process's status (``abort`` raises)."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    if trailing:
        context.set_trailing_metadata(tuple(trailing))
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNAVAILABLE
    if code is grpc.StatusCode.UNAVAILABLE and not (error.details() or "").strip():
        context.abort(code, "the server process is not reachable")
    context.abort(code, error.details() or "")


def _timeout(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e6 else max(0.001, remaining)


class IngestServer:
    """One ingest process's gRPC server: Submit moved to shared memory, every other RPC passed through.

    ``arena_dir`` None: no shared memory (an ingest endpoint on another host, see
    :class:`clipd.server.ray_shards.IngestActor`): Submit is passed through too.
    """

    def __init__(self, settings: Settings, port: int, owner: str, arena_dir: str | None, index: int,
                 generation: int) -> None:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        from .app import OTHER_STREAMS, server_options
        from .reflection import enable_reflection

        self.settings, self.index = settings, index
        arena_bytes = max(4 * settings.max_message_bytes,
                          min(256 << 20, settings.max_buffered_bytes // max(1, settings.processes)))
        self.arena = Arena(arena_dir, f"ingest-{index}-{generation}", arena_bytes) if arena_dir else None
        limit = settings.max_message_bytes + (1 << 16)
        self.channel = grpc.insecure_channel(owner, options=[("grpc.max_receive_message_length", limit),
                                                             ("grpc.max_send_message_length", limit)])
        options = [(k, v) for k, v in server_options(settings) if k != "grpc.so_reuseport"]
        self.server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(settings.max_streams + OTHER_STREAMS + settings.unary_workers,
                                                  thread_name_prefix="clipd-ingest"),
            options=[*options, ("grpc.so_reuseport", 1)])
        self.server.add_generic_rpc_handlers((self._handlers(),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection((SERVICE.full_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
                          self.server)
        from .tls import grpc_server_credentials

        address = f"{settings.host}:{port}"
        credentials = grpc_server_credentials(settings)
        bound = (self.server.add_secure_port(address, credentials) if credentials is not None
                 else self.server.add_insecure_port(address))
        if port and bound != port:
            raise RuntimeError(f"ingest {index}: bound port {bound}, not {port}")
        self.port = bound
        self._serving = health_pb2.HealthCheckResponse.SERVING

    def _handlers(self) -> grpc.GenericRpcHandler:
        handlers = {}
        for method in SERVICE.methods:
            path = f"/{SERVICE.full_name}/{method.name}"
            if method.name == "Submit":
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(self._submit_handler(path))
            elif method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(self._unary_stream_handler(path))
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(self._unary_handler(path))
        return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)

    def _unary_handler(self, path: str):
        call = self.channel.unary_unary(path)

        def forward(request: bytes, context):
            try:
                future = call.future(request, metadata=_forwarded_metadata(context, self.index),
                                     timeout=_timeout(context))
                context.add_callback(future.cancel)
                return future.result()
            except grpc.RpcError as e:
                _relay(context, e)

        return forward

    def _unary_stream_handler(self, path: str):
        call = self.channel.unary_stream(path)

        def forward(request: bytes, context):
            responses = call(request, metadata=_forwarded_metadata(context, self.index), timeout=_timeout(context))
            context.add_callback(responses.cancel)
            try:
                yield from responses
            except grpc.RpcError as e:
                _relay(context, e)

        return forward

    def _submit_handler(self, path: str):
        call = self.channel.stream_stream(path)
        release = self.channel.unary_unary(RELEASE_METHOD)

        def forward(request_iterator, context):
            refused: list[ClipdError] = []
            shared = _CallRegions(self.arena)
            responses = call(self._to_shared(request_iterator, refused, shared),
                             metadata=_forwarded_metadata(context, self.index))
            context.add_callback(responses.cancel)
            try:
                yield from responses
            except grpc.RpcError as e:
                if not refused:
                    _relay(context, e)
            finally:  # the server reads no more of this call: the regions it never read go back
                if unread := shared.close():
                    with contextlib.suppress(grpc.RpcError):
                        release(json.dumps(unread).encode(), timeout=30)
            if refused:  # this process refused a message: the stream was cut short
                context.set_trailing_metadata(refused[0].trailing_metadata())
                context.abort(refused[0].code, str(refused[0]))

        return forward

    def _to_shared(self, messages, refused: list, shared: _CallRegions | None):
        """The client's messages, each chunk's data moved into the arena (``shared`` keeps the references)."""
        wait = self.settings.buffer_wait
        if self.arena is None:
            yield from messages
            return
        try:
            for raw in messages:
                try:
                    message = wire.parse_submit_request(raw)
                except ValueError as e:  # refused here: raw bytes never go on (they could name regions)
                    raise InvalidArgument(f"malformed SubmitRequest: {type(e).__name__}: {e}") from None
                del raw
                if not message.chunks:
                    yield wire.encode_shared(message, [])
                    continue
                refs = [shared.put(chunk.data, wait) for chunk in message.chunks]
                yield wire.encode_shared(message, refs)
        except _CallEnded:
            return
        except ClipdError as e:
            refused.append(e)  # ends the forwarded stream; the handler answers the client with it

    def start(self) -> IngestServer:
        self.server.start()
        self.health.set("", self._serving)
        self.health.set(SERVICE.full_name, self._serving)
        return self

    def stop(self, grace: float) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1.0)
        self.channel.close()
        if self.arena is not None:
            self.arena.close()


def main() -> None:
    """An ingest process (``python -m clipd.server.ingest``, started by the server process).

    Reads its orders as one JSON line on stdin, answers ``ready`` on stdout once
    it listens, and serves until SIGTERM, or until the server process (its parent) is gone.
    """
    orders = json.loads(sys.stdin.readline())
    settings = Settings(**orders["settings"])
    from . import logs

    logs.configure(settings.log_level, settings.log_format)
    parent = os.getppid()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us
    server = IngestServer(settings, orders["port"], orders["owner"], orders["arena_dir"], orders["index"],
                          orders["generation"]).start()
    print("ready", flush=True)
    while not done.wait(0.5):
        if os.getppid() != parent:  # the server process died (SIGKILL): nothing to forward to
            break
    server.stop(settings.shutdown_grace if done.is_set() else 0.0)
    os._exit(0)


def shared_memory_dir(least: int = 1 << 30) -> str | None:
    """``/dev/shm`` when it is there with ``least`` bytes free (memory, not disk); else None (the temp dir)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if stat.f_bavail * stat.f_frsize >= least and os.access("/dev/shm", os.W_OK) else None


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, not listening, SO_REUSEPORT socket: holds the port (``0``: a free one) for the ingest processes."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host.strip("[]"), port))
    return sock


class IngestProcesses:
    """The server process's side: starts ``settings.processes`` ingest processes and restarts any that dies."""

    def __init__(self, settings: Settings, port: int, owner: str, arena_dir: str, on_restart=None,
                 on_start=None) -> None:
        self.settings, self.port, self.owner, self.arena_dir = settings, port, owner, arena_dir
        self.on_restart = on_restart  # called with a dead process's segment prefix (the server unmaps them)
        self.on_start = on_start  # called with a new process's segment name (the server maps it)
        self._processes: list[subprocess.Popen | None] = [None] * settings.processes
        self.restarts = [0] * settings.processes
        self._generation = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="clipd-ingest-watch", daemon=True)

    def _spawn(self, index: int, timeout: float = 120.0) -> None:
        """A new interpreter (not a fork: this process has gRPC and JAX threads), ready when it returns."""
        self._generation += 1
        process = subprocess.Popen([sys.executable, "-m", "clipd.server.ingest"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        orders = {"settings": dataclasses.asdict(self.settings), "port": self.port, "owner": self.owner,
                  "arena_dir": self.arena_dir, "index": index, "generation": self._generation}
        process.stdin.write(json.dumps(orders) + "\n")
        process.stdin.close()
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if answer != ["ready\n"]:
            process.kill()
            process.wait()
            raise RuntimeError(f"ingest process {index} did not start within {timeout:g} s"
                               f" (exit status {process.returncode})")
        process.stdout.close()
        self._processes[index] = process
        if self.on_start is not None:
            self.on_start(f"ingest-{index}-{self._generation}")

    def start(self) -> IngestProcesses:
        with self._lock:
            for index in range(len(self._processes)):
                self._spawn(index)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                for index, process in enumerate(self._processes):
                    if process is not None and process.poll() is not None and not self._stopping.is_set():
                        log.warning("ingest process %d (pid %d) exited with %s; starting another",
                                    index, process.pid, process.returncode, extra={"event": "ingest.restarted"})
                        self._remove_segments(index)
                        if self.on_restart is not None:
                            self.on_restart(f"ingest-{index}-")
                        self.restarts[index] += 1
                        try:
                            self._spawn(index)
                        except Exception:
                            log.exception("could not restart ingest process %d", index)

    def _remove_segments(self, index: int) -> None:
        """A dead process's arena files (mapped by the server process until its views are gone)."""
        for name in os.listdir(self.arena_dir):
            if name.startswith(f"ingest-{index}-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.arena_dir, name))

    def describe(self) -> list[dict]:
        with self._lock:
            return [{"index": i, "pid": p.pid if p else None, "alive": bool(p and p.poll() is None),
                     "restarts": self.restarts[i]} for i, p in enumerate(self._processes)]

    def stop(self, grace: float) -> None:
        self._stopping.set()
        with self._lock:
            processes = [p for p in self._processes if p is not None]
        for process in processes:
            if process.poll() is None:
                process.terminate()  # SIGTERM: the ingest process stops its gRPC server with ``grace``
        deadline = time.monotonic() + grace + 2.0
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for index in range(len(self._processes)):
            self._remove_segments(index)


if __name__ == "__main__":
    main()
