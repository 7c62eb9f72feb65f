"""Server settings: validated once, from keyword arguments or CLIPD_* environment variables."""

from __future__ import annotations

import dataclasses
import os
import pathlib

MiB = 1 << 20


def default_data_dir() -> str:
    """The per-user state directory: ``$XDG_STATE_HOME/clipd``, else ``~/.local/state/clipd``."""
    base = os.environ.get("XDG_STATE_HOME") or str(pathlib.Path.home() / ".local" / "state")
    return str(pathlib.Path(base) / "clipd")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the server can be told. Environment: ``CLIPD_<FIELD>`` (upper case)."""

    host: str = "127.0.0.1"  # beyond loopback only with admin_token set, or insecure
    grpc_port: int = 50051  # 0 picks a free port
    admin_port: int = 8080  # 0 picks a free port; -1 disables the admin API
    max_message_bytes: int = 16 * MiB  # largest gRPC message either way
    max_batch_bytes: int = 256 * MiB  # largest batch (all its chunks)
    max_buffered_bytes: int = 1024 * MiB  # partly received and queued batches of all streams together
    buffer_wait: float = 5.0  # seconds a new batch waits for room in max_buffered_bytes before RESOURCE_EXHAUSTED
    max_aggregations: int = 64  # open at once (finalized ones are kept until cancelled)
    max_parameters: int = 1 << 27  # elements of one aggregation (all layers)
    max_total_parameters: int = 1 << 28  # elements of all open aggregations together
    max_layers: int = 4096  # layers of one aggregation
    max_name_length: int = 256  # characters of a layer name
    max_clients: int = 100_000  # distinct client_ids of one aggregation
    warmup_timeout: float = 300.0  # an aggregation whose compilation takes longer fails
    max_device_rows: int = 4096  # examples per device step, rounded down to a power of two
    staging_bytes: int = 16 * MiB  # host buffer (x2) per aggregation that examples are packed into
    max_streams: int = 256  # Submit streams at once; more get RESOURCE_EXHAUSTED with a retry hint
    unary_workers: int = 16  # threads kept for unary RPCs and health checks, whatever the streams do
    stream_idle_timeout: float = 30.0  # a Submit stream that sends nothing for this long is closed
    admin_token: str = ""  # the admin credential: every RPC and admin route; "" = auth off (loopback only)
    insecure: bool = False  # allow listening beyond loopback without admin_token
    tls_cert_file: str = ""  # PEM certificate (chain): gRPC and the admin API (HTTPS) serve TLS with it
    tls_key_file: str = ""  # PEM private key of tls_cert_file
    tls_client_ca_file: str = ""  # PEM CA bundle: gRPC requires client certificates it signed (mutual TLS)
    compilation_cache_dir: str = ""  # JAX persistent compilation cache ("" = off)
    # Durability: aggregations, checkpoints and results live here ("memory": nothing survives a restart).
    data_dir: str = dataclasses.field(default_factory=default_data_dir)
    checkpoint_interval: float = 0.01  # seconds between checkpoint starts (the acknowledgement latency)
    checkpoint_max_duty: float = 0.25  # large states: checkpoints spaced so writing takes <= this share
    finalize_timeout: float = 300.0  # Finalize waits at most this long for accepted batches to be summed
    retention_seconds: float = 86400.0  # finalized and failed aggregations are deleted after this

    def __post_init__(self) -> None:
        for field in ("max_message_bytes", "max_batch_bytes", "max_buffered_bytes", "max_aggregations",
                      "max_parameters", "max_total_parameters", "max_layers", "max_name_length", "max_clients",
                      "max_device_rows", "staging_bytes", "max_streams", "unary_workers"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Settings.{field} must be positive, got {getattr(self, field)}")
        for field in ("checkpoint_interval", "finalize_timeout", "retention_seconds", "buffer_wait",
                      "warmup_timeout", "stream_idle_timeout"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Settings.{field} must be positive, got {getattr(self, field)}")
        if not 0 < self.checkpoint_max_duty <= 1:
            raise ValueError(f"Settings.checkpoint_max_duty must be in (0, 1], got {self.checkpoint_max_duty}")
        if self.max_batch_bytes > self.max_buffered_bytes:
            raise ValueError("Settings.max_batch_bytes can't exceed max_buffered_bytes (no batch could ever fit)")
        if not self.data_dir:
            raise ValueError("Settings.data_dir must name a directory (or 'memory')")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("Settings: tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("Settings.tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        for field in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            path = getattr(self, field)
            if path and not os.path.isfile(path):
                raise ValueError(f"Settings.{field}: no such file {path!r}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> Settings:
        """Settings from ``CLIPD_*`` variables, then ``overrides`` (those that are not None)."""
        environ = os.environ if environ is None else environ
        values = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(f"CLIPD_{field.name.upper()}")
            if raw is not None:
                if field.type == "int":
                    values[field.name] = int(raw)
                elif field.type == "float":
                    values[field.name] = float(raw)
                elif field.type == "bool":
                    values[field.name] = raw.strip().lower() in ("1", "true", "yes", "on")
                else:
                    values[field.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
