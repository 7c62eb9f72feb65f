"""Every conversion between protobuf messages and the engine's types, in one module.

The wire's own rules (dtype codes, the enums' names, chunking) are :mod:`clipd.wire`'s, shared
with the client: the engine's enums take the wire's names as their values.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from clipd import wire
from clipd.engine import BoundKind, ClipPolicy, LayerSpec, NonFinite, Unit
from clipd.engine import _privacy as dp
from clipd.engine._audit import DEFAULT_CONFIDENCE, CanaryAudit
from clipd.engine._correlated import CorrelatedNoise, Mechanism
from clipd.server.aggregations import State, Stats
from clipd.server.errors import InvalidArgument
from clipd.v1 import clipd_pb2 as pb

KINDS = {code: BoundKind(name) for name, code in wire.CLIP_KINDS.items()}
NON_FINITE = {  # REJECT never reaches the engine: its batches are rejected on arrival
    pb.ClipPolicy.NON_FINITE_UNSPECIFIED: NonFinite.ZERO_EXAMPLE,
    **{code: NonFinite("zero_example" if name == "reject" else name) for name, code in wire.NON_FINITE.items()},
}
SAMPLING = {code: dp.SamplingKind(name) for name, code in wire.SAMPLING.items()}
DRAWN_BY = {code: dp.DrawnBy(name) for name, code in wire.DRAWN_BY.items()}
NEIGHBOURING = {code: dp.Neighbouring(name) for name, code in wire.NEIGHBOURING.items()}
ACCOUNTANTS = {code: dp.Accountant(name) for name, code in wire.ACCOUNTANTS.items()}
NOISES = {code: dp.Noise(name) for name, code in wire.NOISES.items()}
MECHANISMS = {code: Mechanism(name) for name, code in wire.MECHANISMS.items()}
UNITS: dict[int, Unit] = {pb.UNIT_UNSPECIFIED: Unit.EXAMPLE, **{code: Unit(name) for name, code in wire.UNITS.items()}}
STATES = {  # FINALIZING has no proto state: it still reports OPEN
    State.WARMING_UP: pb.Aggregation.WARMING_UP,
    State.OPEN: pb.Aggregation.OPEN,
    State.FINALIZING: pb.Aggregation.OPEN,
    State.FINALIZED: pb.Aggregation.FINALIZED,
    State.CANCELLED: pb.Aggregation.CANCELLED,
    State.FAILED: pb.Aggregation.FAILED,
}

ID_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


def dtype_of(code: int, where: str) -> np.dtype:
    if code not in wire.DTYPE_NAMES:
        raise InvalidArgument(f"{where}: unsupported dtype {code} (use FLOAT32, FLOAT16, BFLOAT16 or FLOAT64)")
    return wire.numpy_dtype(wire.DTYPE_NAMES[code])


def layers_from_proto(layers) -> tuple[LayerSpec, ...]:
    if not layers:
        raise InvalidArgument("layers: at least one layer is needed")
    specs, names = [], set()
    for k, layer in enumerate(layers):
        if not layer.name or layer.name in names:
            raise InvalidArgument(f"layers[{k}]: a unique, non-empty name is needed, got {layer.name!r}")
        if any(d <= 0 for d in layer.shape):
            raise InvalidArgument(f"layer {layer.name!r}: dimensions must be positive, got {list(layer.shape)}")
        names.add(layer.name)
        dtype = dtype_of(layer.dtype, f"layer {layer.name!r}")
        if dtype == np.float64 and not _x64_enabled():
            raise InvalidArgument(
                f"layer {layer.name!r}: FLOAT64 layers need a server running JAX with float64 enabled"
                " (JAX_ENABLE_X64=1); send FLOAT32 (sums are kept in float64 on the host either way)"
            )
        specs.append(LayerSpec(layer.name, tuple(layer.shape), str(dtype)))
    return tuple(specs)


def _x64_enabled() -> bool:
    import jax

    return bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]  # a flag jax sets at runtime; not in its stub


def privacy_from_proto(message: pb.PrivacyPolicy) -> dp.PrivacyPolicy:
    """The engine's privacy policy; ``InvalidArgument`` naming what is wrong."""
    for value, names, what in ((message.sampling.kind, SAMPLING, "sampling.kind"),
                               (message.sampling.drawn_by, DRAWN_BY, "sampling.drawn_by"),
                               (message.neighbouring, NEIGHBOURING, "neighbouring"),
                               (message.accountant, ACCOUNTANTS, "accountant"),
                               (message.noise, NOISES, "noise")):
        if value not in names:
            raise InvalidArgument(f"privacy.{what}: unknown value {value}")
    if message.ledger_id:
        _check_ledger_id(message.ledger_id)
    adaptive = None
    if message.HasField("adaptive"):
        a = message.adaptive
        adaptive = dp.AdaptiveClipping(a.target_unclipped_quantile, a.learning_rate, a.count_stddev,
                                       a.initial_bound, a.min_bound, a.max_bound or math.inf,
                                       geometric_update=not a.arithmetic_update)
    s = message.sampling
    try:
        correlated = None
        if message.HasField("correlated"):
            c = message.correlated
            if c.mechanism not in MECHANISMS:
                raise InvalidArgument(f"privacy.correlated.mechanism: unknown value {c.mechanism} (blt or banded)")
            correlated = CorrelatedNoise(MECHANISMS[c.mechanism], c.releases, c.min_separation, c.max_participations,
                                         c.buffers, c.declared)
        audit = None
        if message.HasField("audit"):
            audit = CanaryAudit(message.audit.canaries, message.audit.confidence or DEFAULT_CONFIDENCE)
        participation = None
        if message.HasField("participation"):
            participation = dp.Participation(message.participation.min_separation,
                                             message.participation.max_participations)
        return dp.PrivacyPolicy(
            ledger_id=message.ledger_id, delta=message.delta,
            noise_multiplier=message.noise_multiplier if message.HasField("noise_multiplier") else None,
            target_epsilon=(message.target_epsilon or None) if not message.HasField("noise_multiplier") else None,
            planned_releases=message.planned_releases, neighbouring=NEIGHBOURING[message.neighbouring],
            sampling=dp.Sampling(SAMPLING[s.kind], s.rate, s.population, s.sample_size, DRAWN_BY[s.drawn_by]),
            accountant=ACCOUNTANTS[message.accountant], max_epsilon=message.max_epsilon or math.inf,
            adaptive=adaptive, public_denominator=message.public_denominator, release_mean=message.release_mean,
            metrics_noise_multiplier=message.metrics_noise_multiplier,
            seed=message.seed if message.HasField("seed") else None,
            debug_raw_statistics=message.debug_raw_statistics, noise=NOISES[message.noise], correlated=correlated,
            audit=audit, participation=participation,
        )
    except ValueError as e:
        raise InvalidArgument(f"privacy: {e}") from None


def privacy_to_proto(policy: dp.PrivacyPolicy) -> pb.PrivacyPolicy:
    fields = dataclasses.asdict(policy)  # named as the client's Privacy (the enums' values: the wire's names), but:
    sampling, adaptive, correlated = fields.pop("sampling"), fields["adaptive"], fields.pop("correlated")
    participation = fields.pop("participation")
    if participation is not None:  # flat, as the client's Privacy has it
        fields.update(min_separation=participation["min_separation"],
                      max_participations=participation["max_participations"])
    if correlated is not None:  # flat, as the client's Privacy has it (the strategy is the ledger's)
        fields.update(mechanism=correlated["mechanism"], releases=correlated["releases"],
                      min_separation=correlated["min_separation"],
                      max_participations=correlated["max_participations"], buffers=correlated["buffers"],
                      declared_participation=correlated["declared"])
    if adaptive is not None:
        adaptive.update(max_bound=_inf_as_zero(adaptive["max_bound"]),
                        arithmetic_update=not adaptive.pop("geometric_update"))
    fields.update(sampling=sampling["kind"], sampling_rate=sampling["rate"], population=sampling["population"],
                  sample_size=sampling["sample_size"], drawn_by=sampling["drawn_by"],
                  target_epsilon=policy.target_epsilon or 0.0, max_epsilon=_inf_as_zero(policy.max_epsilon))
    return wire.privacy_policy(**fields)


def _inf_as_zero(value: float) -> float:
    return 0.0 if math.isinf(value) else value


def _check_ledger_id(value: str, what: str = "privacy.ledger_id") -> None:
    if not ID_PATTERN.fullmatch(value):
        raise InvalidArgument(f"{what}: 1 to 128 letters, digits, '-', '_' or '.'")


def ledger_id(value: str) -> str:
    """A ledger id (``InvalidArgument`` if it is not one)."""
    _check_ledger_id(value, "ledger_id")
    return value


def ledger_to_proto(ledger: dict) -> pb.Ledger:
    return pb.Ledger(
        ledger_id=ledger["ledger_id"], accountant=ledger["accountant"], neighbouring=ledger["neighbouring"],
        delta=ledger["delta"], max_epsilon=_inf_as_zero(ledger["max_epsilon"]),
        epsilon=ledger["epsilon"], budget_left=ledger["budget_left"], next_bound=ledger["next_bound"],
        debug_raw_statistics=ledger["debug_raw_statistics"], mechanism=ledger["mechanism"],
        stream=_stream_to_proto(ledger["mechanism"], ledger["stream"]),
        stream_made=ledger["stream"]["made"] if ledger["stream"] else 0,
        stream_state_rows=ledger["stream"]["state_rows"] if ledger["stream"] else 0,
        stream_state_bytes=ledger["stream"]["state_bytes"] if ledger["stream"] else 0,
        unit=wire.UNITS[ledger["unit"]], client_ids=ledger["client_ids"],
        sampling_drawn_by=ledger["drawn_by"],
        entries=[pb.LedgerEntry(aggregation_id=e["aggregation_id"], dp_event_json=e["event"],
                                epsilon_after=e["epsilon_after"], unix_seconds=e["time"],
                                next_bound=e["next_bound"] or 0.0) for e in ledger["entries"]],
        audit=pb.LedgerAudit(**ledger["audit"]) if ledger.get("audit") else None,
    )




def _stream_to_proto(mechanism: str, stream: dict | None) -> pb.CorrelatedNoise | None:
    if stream is None:
        return None
    return pb.CorrelatedNoise(mechanism=wire.MECHANISMS[mechanism], releases=stream["releases"],
                              min_separation=stream["min_separation"],
                              max_participations=stream["max_participations"], buffers=stream["buffers"],
                              declared=stream["declared"], strategy=stream.get("strategy", ()))


def unit_from_proto(value: int) -> Unit:
    if value not in UNITS:
        raise InvalidArgument(f"unit: unknown value {value} (EXAMPLE or CLIENT)")
    return UNITS[value]


def release_to_proto(fields: dict) -> pb.Release:
    """A release's fields (as kept with it; older releases lack the newer ones) as the proto ``Release``."""
    fields = dict(fields)
    stream = fields.pop("stream", None)
    unit = fields.pop("unit", Unit.EXAMPLE.value)
    return pb.Release(**fields, unit=wire.UNITS[unit],
                      stream=_stream_to_proto(stream["mechanism"], stream) if stream else None)


def policy_from_proto(policy: pb.ClipPolicy, num_layers: int) -> tuple[ClipPolicy, bool]:
    """The engine policy, and whether batches holding non-finite values are rejected."""
    if policy.kind not in KINDS:
        raise InvalidArgument("policy.kind: choose GLOBAL, PER_LAYER_UNIFORM, PER_LAYER_PROPORTIONAL or"
                              " PER_LAYER_EXPLICIT")
    kind = KINDS[policy.kind]
    if kind is BoundKind.PER_LAYER_EXPLICIT and len(policy.layer_clips) != num_layers:
        raise InvalidArgument(
            f"policy.layer_clips: expected one bound per layer ({num_layers}), got {len(policy.layer_clips)}"
        )
    try:
        engine_policy = ClipPolicy(
            kind=kind,
            l2_norm_clip=policy.l2_norm_clip if kind is not BoundKind.PER_LAYER_EXPLICIT else 1.0,
            layer_clips=tuple(policy.layer_clips),
            rescale_to_unit_norm=policy.rescale_to_unit_norm,
            non_finite=NON_FINITE[policy.non_finite],
        )
    except ValueError as e:
        raise InvalidArgument(f"policy: {e}") from None
    return engine_policy, policy.non_finite == pb.ClipPolicy.REJECT


def policy_to_proto(policy: ClipPolicy, reject_non_finite: bool) -> pb.ClipPolicy:
    return wire.clip_policy(policy.kind.value, "reject" if reject_non_finite else policy.non_finite.value,
                            l2_norm_clip=policy.l2_norm_clip, layer_clips=policy.layer_clips,
                            rescale_to_unit_norm=policy.rescale_to_unit_norm)


def tensor_chunks(layer: int, array: np.ndarray, max_bytes: int):
    """One tensor (a sum) as TensorChunk messages of at most ``max_bytes`` of data each."""
    data, code, step = wire.tensor_bytes(array), wire.dtype_code(array.dtype), max(1, max_bytes)
    for offset in wire.chunk_offsets(len(data), step):
        yield pb.TensorChunk(layer=layer, dtype=code, shape=array.shape, offset=offset,
                             data=bytes(data[offset : offset + step]))


def stats_to_proto(stats: Stats) -> pb.AggregationStats:
    return pb.AggregationStats(
        aggregation_id=stats.aggregation_id,
        state=STATES[stats.state],
        examples=stats.examples,
        batches=stats.batches,
        bytes=stats.bytes,
        non_finite=stats.non_finite,
        clipped=stats.clipped,
        layers=[
            pb.LayerStats(name=layer.name, bound=layer.bound, clipped=layer.clipped, norm_mean=layer.norm_mean,
                          norm_max=layer.norm_max, norm_histogram=layer.norm_histogram)
            for layer in stats.layers
        ],
        bucket_upper_bounds=stats.bucket_upper_bounds,
        example_norm_histogram=stats.example_norm_histogram,
        example_bound=stats.example_bound,
        updated_unix_seconds=stats.updated_unix_seconds,
        examples_per_second=stats.examples_per_second,
        failure_reason=stats.failure_reason,
        privacy_notice=stats.privacy_notice,
        release=release_to_proto(stats.release) if stats.release is not None else None,
    )


class Malformed:
    """What a request deserializer returns for bytes that do not parse (the handler refuses it)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def lenient(parse):
    """``parse`` that returns :class:`Malformed` instead of raising: the RPC then gets INVALID_ARGUMENT.

    gRPC's own handling of a raising deserializer is INTERNAL, a traceback per
    message, and RPCs left half-open.
    """

    def parse_or_malformed(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # any parse failure: refused by the handler, with one log line
            return Malformed(f"{type(e).__name__}: {e}")

    return parse_or_malformed
