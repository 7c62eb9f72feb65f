"""Server settings: validated once, from keyword arguments, flags, CLIPD_* environment variables or a TOML file.

``Settings.load`` merges them: flags > environment > file > defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import os
import pathlib
from collections.abc import Mapping

MiB = 1 << 20


def default_data_dir() -> str:
    """The per-user state directory: ``$XDG_STATE_HOME/clipd``, else ``~/.local/state/clipd``."""
    base = os.environ.get("XDG_STATE_HOME") or str(pathlib.Path.home() / ".local" / "state")
    return str(pathlib.Path(base) / "clipd")


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach: 127.0.0.0/8, ::1, localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the server can be told. Environment: ``CLIPD_<FIELD>`` (upper case)."""

    host: str = "127.0.0.1"  # beyond loopback only with admin_token set, or insecure
    grpc_port: int = 50051  # 0 picks a free port
    admin_port: int = 8080  # 0 picks a free port; -1 disables the admin API
    max_message_bytes: int = 16 * MiB  # largest gRPC message either way
    # What the server may hold for the sums of open aggregations and the updates in flight; 0: 3/4 of the
    # machine's memory (or of its cgroup's limit). max_batch_bytes, max_buffered_bytes, max_parameters and
    # max_total_parameters follow from it unless set.
    memory_budget: int = 0
    max_batch_bytes: int = 0  # largest batch (all its chunks); 0: whatever the buffer has room for
    # Partly received and queued batches of all streams together; 0: what memory_budget leaves once the open
    # aggregations' sums are counted (8 or 12 bytes a parameter and shard: Aggregation.state_bytes), recomputed at
    # each batch.
    max_buffered_bytes: int = 0
    buffer_wait: float = 5.0  # seconds a new batch waits for room in max_buffered_bytes before RESOURCE_EXHAUSTED
    max_aggregations: int = 64  # open at once (finalized ones are kept until cancelled)
    # Elements of one aggregation (all layers); 0: what memory_budget holds for one (12 bytes a parameter: its
    # float64 sums and one float32 update in flight; a model that large has one example a step, so no delta).
    max_parameters: int = 0
    max_total_parameters: int = 0  # elements of all open aggregations together; 0: memory_budget decides
    max_layers: int = 4096  # layers of one aggregation
    max_name_length: int = 256  # characters of a layer name
    max_clients: int = 100_000  # distinct client_ids of one aggregation
    warmup_timeout: float = 300.0  # an aggregation whose compilation takes longer fails
    max_device_rows: int = 4096  # examples per device step, rounded down to a power of two
    staging_bytes: int = 16 * MiB  # host buffer (x2) per aggregation that examples are packed into
    max_streams: int = 256  # Submit streams at once; more get RESOURCE_EXHAUSTED with a retry hint
    # One-message submissions (SubmitOne): max_streams run at once, this many more wait their turn (unread);
    # beyond, RESOURCE_EXHAUSTED with an appointment (rpc.limits.Admission).
    one_message_queue: int = 8192
    unary_workers: int = 16  # threads kept for unary RPCs and health checks, whatever the streams do
    stream_idle_timeout: float = 30.0  # a Submit stream that sends nothing for this long is closed
    admin_token: str = ""  # the admin credential: every RPC and admin route; "" = auth off (loopback only)
    insecure: bool = False  # allow listening beyond loopback without admin_token
    tls_cert_file: str = ""  # PEM certificate (chain): gRPC and the admin API (HTTPS) serve TLS with it
    tls_key_file: str = ""  # PEM private key of tls_cert_file
    tls_client_ca_file: str = ""  # PEM CA bundle: gRPC requires client certificates it signed (mutual TLS)
    # How clipd's own processes on other hosts (Ray shard hosts) reach the server and each other
    # under TLS: they verify the certificate against this CA bundle (default tls_client_ca_file, else the
    # system's CAs) and present tls_cert_file as their client certificate (so, under mutual TLS, it must
    # allow client authentication too). They connect by address: tls_peer_name is the name the certificate
    # must hold (default: the address's host).
    tls_peer_ca_file: str = ""
    tls_peer_name: str = ""  # the name clipd's processes on other hosts expect in the server's certificate
    compilation_cache_dir: str = ""  # JAX persistent compilation cache ("" = off)
    # Load the privacy accountant (dp_accounting, scipy) and compile the release keys' program on a thread once
    # serving (~2.7 s of a core), so that a first private release need not wait for them; not on a restart with
    # open aggregations to finish; off: loaded at first use (a server that never releases privately: ~60 MB less)
    warm_privacy: bool = True
    shards: int = 0  # shards of each new aggregation (client id -> shard); 0 = one per local JAX device
    processes: int = 0  # shard processes on the gRPC port (receive, parse, clip, sum); 0 = this process does it all
    advertise_host: str = ""  # the host name clients reach the shard processes' own ports by ("": host)
    shard_ports: int = 0  # the first of `processes` consecutive ports of the shard processes (0: free ports)
    # A Ray cluster (HOST:PORT): shard hosts on its nodes receive and sum; needs a postgresql:// data_dir.
    ray_address: str = ""
    ray_shard_hosts: int = 0  # with ray_address: how many shard hosts (0: one on each node of the cluster)
    ray_gpus_per_host: float = 0.0  # with ray_address: GPUs each shard host asks Ray for (1: a GPU each)
    ray_ingest_port: int = 50052  # the port clients reach the shard hosts on, on every node (shared: SO_REUSEPORT)
    # Durability: aggregations, checkpoints and results live here ("memory": nothing survives a restart).
    data_dir: str = dataclasses.field(default_factory=default_data_dir)
    checkpoint_interval: float = 0.01  # seconds between checkpoint starts (the acknowledgement latency)
    checkpoint_max_duty: float = 0.25  # large states: checkpoints spaced so writing takes <= this share
    # While a crowd of one-message calls is in flight (two or more at once: a round's clients), checkpoints are
    # spaced this far: each call waits a little longer, none of them waits on another, and fewer checkpoints
    # (each writes the whole state) leave the CPU to the calls.
    busy_checkpoint_interval: float = 0.05
    finalize_timeout: float = 300.0  # Finalize waits at most this long for accepted batches to be summed
    retention_seconds: float = 86400.0  # finalized and failed aggregations are deleted after this
    shutdown_grace: float = 10.0  # on SIGTERM, open streams get this long; the process exits 5 s after at most
    log_level: str = "info"  # debug, info, warning or error
    log_format: str = "text"  # text, or json: one JSON object a line

    def __post_init__(self) -> None:
        for field in ("max_message_bytes", "max_aggregations", "max_layers", "max_name_length", "max_clients",
                      "max_device_rows", "staging_bytes", "max_streams", "unary_workers", "one_message_queue"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Settings.{field} must be positive, got {getattr(self, field)}")
        for field in ("memory_budget", "max_batch_bytes", "max_buffered_bytes", "max_parameters",
                      "max_total_parameters"):
            if getattr(self, field) < 0:
                raise ValueError(f"Settings.{field} must be positive (or 0: derived from memory_budget), got"
                                 f" {getattr(self, field)}")
        for field in ("checkpoint_interval", "busy_checkpoint_interval", "finalize_timeout", "retention_seconds",
                      "buffer_wait", "warmup_timeout", "stream_idle_timeout", "shutdown_grace"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Settings.{field} must be positive, got {getattr(self, field)}")
        if self.ray_address and not self.data_dir.startswith(("postgresql://", "postgres://")):
            raise ValueError("Settings.ray_address: shard hosts on other machines need the shared store;"
                             " set data_dir to a postgresql:// URL")
        if self.ray_shard_hosts < 0:
            raise ValueError(f"Settings.ray_shard_hosts must be >= 0 (0: one on each node), got {self.ray_shard_hosts}")
        if self.ray_shard_hosts and not self.ray_address:
            raise ValueError("Settings.ray_shard_hosts: shard hosts run on a Ray cluster; set ray_address")
        if self.ray_gpus_per_host < 0:
            raise ValueError(f"Settings.ray_gpus_per_host must be >= 0, got {self.ray_gpus_per_host}")
        if self.processes < 0:
            raise ValueError(f"Settings.processes must be >= 0 (0: one process), got {self.processes}")
        if self.processes and self.ray_address:
            raise ValueError("Settings: processes or ray_address, not both (shard processes on this host, or shard"
                             " hosts on a Ray cluster)")
        if self.processes and self.data_dir == "memory":
            raise ValueError("Settings.processes: shard processes commit their checkpoints to a store the control"
                             " process reads at finalize; set data_dir to a directory or a postgresql:// URL")
        if self.shards < 0:
            raise ValueError(f"Settings.shards must be >= 0 (0: one per device), got {self.shards}")
        if not 0 < self.checkpoint_max_duty <= 1:
            raise ValueError(f"Settings.checkpoint_max_duty must be in (0, 1], got {self.checkpoint_max_duty}")
        if self.buffer_wait >= self.stream_idle_timeout:
            raise ValueError("Settings.buffer_wait must be shorter than stream_idle_timeout (a stream waiting"
                             " for buffer room would be closed as idle)")
        if self.max_batch_bytes and self.max_buffered_bytes and self.max_batch_bytes > self.max_buffered_bytes:
            raise ValueError("Settings.max_batch_bytes can't exceed max_buffered_bytes (no batch could ever fit)")
        if not self.data_dir:
            raise ValueError("Settings.data_dir must name a directory (or 'memory')")
        if "://" in self.data_dir and not self.data_dir.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"Settings.data_dir: a directory, 'memory', or a postgresql:// URL (a shared store),"
                             f" got {self.data_dir.split('://')[0]}://...")
        if not (self.admin_token or self.insecure or is_loopback(self.host)):
            raise ValueError(f"refusing to listen on {self.host} without credentials: set admin_token"
                             " (CLIPD_ADMIN_TOKEN, --admin-token), or listen on loopback, or pass --insecure")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("Settings: tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("Settings.tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if (self.tls_peer_ca_file or self.tls_peer_name) and not self.tls_cert_file:
            raise ValueError("Settings.tls_peer_ca_file and tls_peer_name are for TLS: set tls_cert_file and"
                             " tls_key_file")
        for field in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "tls_peer_ca_file"):
            path = getattr(self, field)
            if path and not os.path.isfile(path):
                raise ValueError(f"Settings.{field}: no such file {path!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"Settings.log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"Settings.log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")

    @property
    def memory(self) -> int:
        """The memory budget in bytes: ``memory_budget``, or 3/4 of what this machine (or cgroup) has."""
        return self.memory_budget or machine_memory() * 3 // 4

    @property
    def parameter_limit(self) -> int:
        """The most parameters one aggregation may have: ``max_parameters``, or what the memory budget holds."""
        return self.max_parameters or self.memory // BYTES_PER_PARAMETER_IN_FLIGHT

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> Settings:
        """Settings from ``CLIPD_*`` variables, then ``overrides`` (those that are not None).

        A variable that does not parse raises :class:`SettingsError` naming it.
        """
        environ = os.environ if environ is None else environ
        values = _values_from_environ(cls, environ)
        values.update({k: (v, f"argument {k}") for k, v in overrides.items() if v is not None})
        return _build(cls, values)

    @classmethod
    def load(cls, flags: dict | None = None, environ: Mapping[str, str] | None = None,
             config_file: str | os.PathLike | None = None) -> Settings:
        """Settings from every source, in this precedence: ``flags`` > ``CLIPD_*`` variables > file > defaults.

        ``flags`` maps field names to values (None = not given). ``config_file`` is a TOML
        file whose keys are field names; without it, ``CLIPD_CONFIG`` names one (if set).
        Unknown keys, values of the wrong type and variables that do not parse raise
        :class:`SettingsError` naming the key and its source, as do invalid combinations.
        """
        environ = os.environ if environ is None else environ
        if config_file is None:
            config_file = environ.get("CLIPD_CONFIG") or None
        values = {} if config_file is None else _values_from_file(cls, config_file)
        values.update(_values_from_environ(cls, environ))
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, value in (flags or {}).items():
            if value is None:
                continue
            flag = "--" + name.replace("_", "-")
            if name not in fields:
                raise SettingsError(f"{flag}: unknown setting {name!r}")
            values[name] = (_checked(fields[name], value, flag), flag)
        return _build(cls, values)


TOTALS_BYTES_PER_PARAMETER = 8  # an open shard's float64 totals
DELTA_BYTES_PER_PARAMETER = 4  # its float32 delta, unless its steps have one example (the worker adds those itself)
BYTES_PER_PARAMETER_IN_FLIGHT = TOTALS_BYTES_PER_PARAMETER + 4  # a large model's totals and one float32 update


@functools.cache
def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_KINDS = {"int": "an integer", "float": "a number", "bool": "a boolean (true or false)", "str": "a string"}


class SettingsError(ValueError):
    """A setting that can't be used; the message names the key and where it came from."""


def field_kind(field: dataclasses.Field) -> str:
    """``"int"``, ``"float"``, ``"bool"``, ``"str"``, or the annotation as written for any other type."""
    return field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))


def _checked(field: dataclasses.Field, value, source: str):
    """``value`` (from a file or a flag) if it has the field's type; ints are taken for floats."""
    kind = field_kind(field)
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }.get(kind, True)
    if not ok:
        raise SettingsError(f"{source}: {field.name} must be {_KINDS[kind]}, got {value!r}")
    return float(value) if kind == "float" else value


def _parsed(field: dataclasses.Field, raw: str, variable: str):
    """The value of an environment variable for ``field``; SettingsError naming the variable if it doesn't parse."""
    kind = field_kind(field)
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise SettingsError(f"{variable} must be {_KINDS[kind]}, got {raw!r}") from None
    if kind == "bool":
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise SettingsError(f"{variable} must be one of {', '.join(_TRUE + _FALSE)}, got {raw!r}")
        return word in _TRUE
    return raw


def _values_from_environ(cls, environ) -> dict[str, tuple]:
    """``{field: (value, variable)}`` for each ``CLIPD_<FIELD>`` set; empty numbers and booleans count as unset."""
    values = {}
    for field in dataclasses.fields(cls):
        variable = f"CLIPD_{field.name.upper()}"
        raw = environ.get(variable)
        if raw is None or (raw.strip() == "" and field_kind(field) in ("int", "float", "bool")):
            continue  # compose's ${VAR:-} gives "" for "not set"
        values[field.name] = (_parsed(field, raw, variable), variable)
    return values


def _values_from_file(cls, path: str | os.PathLike) -> dict[str, tuple]:
    """``{field: (value, path)}`` from a TOML file whose top-level keys are field names."""
    import difflib
    import tomllib

    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise SettingsError(f"config file {where}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"config file {where}: not valid TOML: {e}") from None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SettingsError(f"config file {where}: unknown setting {key!r}{hint}")
        values[key] = (_checked(fields[key], value, f"config file {where}"), where)
    return values


def _build(cls, values: dict[str, tuple]):
    """``cls(**values)``; a ValueError of ``__post_init__`` becomes a SettingsError naming the sources involved."""
    import re

    try:
        return cls(**{name: value for name, (value, _) in values.items()})
    except SettingsError:
        raise
    except ValueError as e:
        message = str(e)
        sources = [f"{name} from {source}" for name, (_, source) in values.items()
                   if re.search(rf"\b{re.escape(name)}\b", message)]
        raise SettingsError(message + (f" ({'; '.join(sources)})" if sources else "")) from None
