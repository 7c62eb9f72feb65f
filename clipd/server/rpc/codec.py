"""Every conversion between protobuf messages and the engine's types, in one module."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import ml_dtypes
import numpy as np

from clipd.engine import BoundKind, ClipPolicy, LayerSpec, NonFinite
from clipd.engine import _privacy as dp
from clipd.server.aggregations import State, Stats
from clipd.server.errors import InvalidArgument
from clipd.v1 import clipd_pb2 as pb

DTYPES: dict[int, np.dtype] = {
    pb.FLOAT32: np.dtype("<f4"),
    pb.FLOAT16: np.dtype("<f2"),
    pb.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    pb.FLOAT64: np.dtype("<f8"),
}
DTYPE_CODES: dict[str, int] = {str(dt): code for code, dt in DTYPES.items()}

KINDS = {
    pb.ClipPolicy.GLOBAL: BoundKind.GLOBAL,
    pb.ClipPolicy.PER_LAYER_UNIFORM: BoundKind.PER_LAYER_UNIFORM,
    pb.ClipPolicy.PER_LAYER_PROPORTIONAL: BoundKind.PER_LAYER_PROPORTIONAL,
    pb.ClipPolicy.PER_LAYER_EXPLICIT: BoundKind.PER_LAYER_EXPLICIT,
}
NON_FINITE = {
    pb.ClipPolicy.NON_FINITE_UNSPECIFIED: NonFinite.ZERO_EXAMPLE,
    pb.ClipPolicy.ZERO_EXAMPLE: NonFinite.ZERO_EXAMPLE,
    pb.ClipPolicy.ZERO_ENTRIES: NonFinite.ZERO_ENTRIES,
    pb.ClipPolicy.PROPAGATE: NonFinite.PROPAGATE,
    pb.ClipPolicy.REJECT: NonFinite.ZERO_EXAMPLE,  # never reaches the engine: rejected on arrival
}
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
    if code not in DTYPES:
        raise InvalidArgument(f"{where}: unsupported dtype {code} (use FLOAT32, FLOAT16, BFLOAT16 or FLOAT64)")
    return DTYPES[code]


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

    return bool(jax.config.jax_enable_x64)


def spec_to_json(layers: tuple[LayerSpec, ...], policy: ClipPolicy, reject_non_finite: bool,
                 privacy: dp.PrivacyPolicy | None = None, shards: int = 1) -> str:
    """An aggregation's layers, policy (with the bound in use), privacy policy and shard count as JSON, for the store."""
    spec = {
        "shards": shards,
        "layers": [[l.name, list(l.shape), l.dtype] for l in layers],
        "policy": {"kind": policy.kind.value, "l2_norm_clip": policy.l2_norm_clip,
                   "layer_clips": list(policy.layer_clips), "rescale_to_unit_norm": policy.rescale_to_unit_norm,
                   "non_finite": policy.non_finite.value},
        "reject_non_finite": reject_non_finite,
    }
    if privacy is not None:
        spec["privacy"] = dataclasses.asdict(privacy)
    return json.dumps(spec)


def spec_from_json(text: str) -> tuple[tuple[LayerSpec, ...], ClipPolicy, bool, dp.PrivacyPolicy | None]:
    """The inverse of :func:`spec_to_json`."""
    spec = json.loads(text)
    layers = tuple(LayerSpec(name, tuple(shape), dtype) for name, shape, dtype in spec["layers"])
    privacy = None
    if "privacy" in spec:
        fields = dict(spec["privacy"])
        fields["sampling"] = dp.Sampling(**fields["sampling"])
        if fields["adaptive"] is not None:
            fields["adaptive"] = dp.AdaptiveClipping(**fields["adaptive"])
        privacy = dp.PrivacyPolicy(**fields)
    return layers, ClipPolicy(**spec["policy"]), bool(spec["reject_non_finite"]), privacy


def spec_shards(text: str) -> int:
    """How many shards the aggregation of :func:`spec_to_json`'s text has (1 if it predates shards)."""
    return int(json.loads(text).get("shards", 1))


SAMPLING = {pb.Sampling.NONE: dp.SamplingKind.NONE, pb.Sampling.POISSON: dp.SamplingKind.POISSON,
            pb.Sampling.FIXED_SIZE: dp.SamplingKind.FIXED_SIZE}
NEIGHBOURING = {pb.PrivacyPolicy.ADD_REMOVE_ONE: dp.Neighbouring.ADD_REMOVE_ONE,
                pb.PrivacyPolicy.REPLACE_ONE: dp.Neighbouring.REPLACE_ONE}
ACCOUNTANTS = {pb.PrivacyPolicy.RDP: dp.Accountant.RDP, pb.PrivacyPolicy.PLD: dp.Accountant.PLD}


def privacy_from_proto(message: pb.PrivacyPolicy) -> dp.PrivacyPolicy:
    """The engine's privacy policy; ``InvalidArgument`` naming what is wrong."""
    for value, names, what in ((message.sampling.kind, SAMPLING, "sampling.kind"),
                               (message.neighbouring, NEIGHBOURING, "neighbouring"),
                               (message.accountant, ACCOUNTANTS, "accountant")):
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
        return dp.PrivacyPolicy(
            ledger_id=message.ledger_id, delta=message.delta,
            noise_multiplier=message.noise_multiplier if message.HasField("noise_multiplier") else None,
            target_epsilon=(message.target_epsilon or None) if not message.HasField("noise_multiplier") else None,
            planned_releases=message.planned_releases, neighbouring=NEIGHBOURING[message.neighbouring],
            sampling=dp.Sampling(SAMPLING[s.kind], s.rate, s.population, s.sample_size),
            accountant=ACCOUNTANTS[message.accountant], max_epsilon=message.max_epsilon or math.inf,
            adaptive=adaptive, public_denominator=message.public_denominator, release_mean=message.release_mean,
            metrics_noise_multiplier=message.metrics_noise_multiplier,
            seed=message.seed if message.HasField("seed") else None,
            debug_raw_statistics=message.debug_raw_statistics,
        )
    except ValueError as e:
        raise InvalidArgument(f"privacy: {e}") from None


def privacy_to_proto(policy: dp.PrivacyPolicy) -> pb.PrivacyPolicy:
    a = policy.adaptive
    message = pb.PrivacyPolicy(
        ledger_id=policy.ledger_id, delta=policy.delta, target_epsilon=policy.target_epsilon or 0.0,
        planned_releases=policy.planned_releases,
        neighbouring={v: k for k, v in NEIGHBOURING.items()}[policy.neighbouring],
        sampling=pb.Sampling(kind={v: k for k, v in SAMPLING.items()}[policy.sampling.kind],
                             rate=policy.sampling.rate, population=policy.sampling.population,
                             sample_size=policy.sampling.sample_size),
        accountant={v: k for k, v in ACCOUNTANTS.items()}[policy.accountant],
        max_epsilon=0.0 if math.isinf(policy.max_epsilon) else policy.max_epsilon,
        public_denominator=policy.public_denominator, release_mean=policy.release_mean,
        metrics_noise_multiplier=policy.metrics_noise_multiplier,
        debug_raw_statistics=policy.debug_raw_statistics,
    )
    if policy.noise_multiplier is not None:
        message.noise_multiplier = policy.noise_multiplier
    if policy.seed is not None:
        message.seed = policy.seed
    if a is not None:
        message.adaptive.CopyFrom(pb.AdaptiveClipping(
            target_unclipped_quantile=a.target_unclipped_quantile, learning_rate=a.learning_rate,
            count_stddev=a.count_stddev, initial_bound=a.initial_bound, min_bound=a.min_bound,
            max_bound=0.0 if math.isinf(a.max_bound) else a.max_bound, arithmetic_update=not a.geometric_update))
    return message


def _check_ledger_id(value: str) -> None:
    if not ID_PATTERN.fullmatch(value):
        raise InvalidArgument("privacy.ledger_id: 1 to 128 letters, digits, '-', '_' or '.'")


def ledger_to_proto(ledger: dict) -> pb.Ledger:
    return pb.Ledger(
        ledger_id=ledger["ledger_id"], accountant=ledger["accountant"], neighbouring=ledger["neighbouring"],
        delta=ledger["delta"], max_epsilon=0.0 if math.isinf(ledger["max_epsilon"]) else ledger["max_epsilon"],
        epsilon=ledger["epsilon"], budget_left=ledger["budget_left"], next_bound=ledger["next_bound"],
        debug_raw_statistics=ledger["debug_raw_statistics"],
        entries=[pb.LedgerEntry(aggregation_id=e["aggregation_id"], dp_event_json=e["event"],
                                epsilon_after=e["epsilon_after"], unix_seconds=e["time"],
                                next_bound=e["next_bound"] or 0.0) for e in ledger["entries"]],
    )


def layers_to_proto(layers) -> list[pb.LayerSpec]:
    return [pb.LayerSpec(name=l.name, shape=l.shape, dtype=DTYPE_CODES[l.dtype]) for l in layers]


def policy_from_proto(policy: pb.ClipPolicy, num_layers: int) -> tuple[ClipPolicy, bool]:
    """The engine policy, and whether batches holding non-finite values are rejected."""
    if policy.kind not in KINDS:
        raise InvalidArgument("policy.kind: choose GLOBAL, PER_LAYER_UNIFORM, PER_LAYER_PROPORTIONAL or PER_LAYER_EXPLICIT")
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
    kinds = {v: k for k, v in KINDS.items()}
    non_finite = {NonFinite.ZERO_EXAMPLE: pb.ClipPolicy.ZERO_EXAMPLE, NonFinite.ZERO_ENTRIES: pb.ClipPolicy.ZERO_ENTRIES,
                  NonFinite.PROPAGATE: pb.ClipPolicy.PROPAGATE}[policy.non_finite]
    return pb.ClipPolicy(
        kind=kinds[policy.kind],
        l2_norm_clip=policy.l2_norm_clip,
        layer_clips=policy.layer_clips,
        rescale_to_unit_norm=policy.rescale_to_unit_norm,
        non_finite=pb.ClipPolicy.REJECT if reject_non_finite else non_finite,
    )


def tensor_chunks(layer: int, array: np.ndarray, max_bytes: int):
    """Splits one little-endian tensor into TensorChunk messages of at most ``max_bytes`` of data."""
    data = memoryview(np.ascontiguousarray(array)).cast("B")
    code = DTYPE_CODES[str(array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype)]
    step = max(1, max_bytes)
    for offset in range(0, max(len(data), 1), step):
        yield pb.TensorChunk(
            layer=layer, dtype=code, shape=array.shape, offset=offset, data=bytes(data[offset : offset + step])
        )


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
            pb.LayerStats(name=l.name, bound=l.bound, clipped=l.clipped, norm_mean=l.norm_mean,
                          norm_max=l.norm_max, norm_histogram=l.norm_histogram)
            for l in stats.layers
        ],
        bucket_upper_bounds=stats.bucket_upper_bounds,
        example_norm_histogram=stats.example_norm_histogram,
        example_bound=stats.example_bound,
        updated_unix_seconds=stats.updated_unix_seconds,
        examples_per_second=stats.examples_per_second,
        failure_reason=stats.failure_reason,
        privacy_notice=stats.privacy_notice,
        release=pb.Release(**stats.release) if stats.release is not None else None,
    )

