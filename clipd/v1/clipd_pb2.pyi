from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrivacyUnit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNIT_UNSPECIFIED: _ClassVar[PrivacyUnit]
    EXAMPLE: _ClassVar[PrivacyUnit]
    CLIENT: _ClassVar[PrivacyUnit]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
UNIT_UNSPECIFIED: PrivacyUnit
EXAMPLE: PrivacyUnit
CLIENT: PrivacyUnit
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType

class LayerSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class ClipPolicy(_message.Message):
    __slots__ = ("kind", "l2_norm_clip", "layer_clips", "rescale_to_unit_norm", "non_finite")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[ClipPolicy.Kind]
        GLOBAL: _ClassVar[ClipPolicy.Kind]
        PER_LAYER_UNIFORM: _ClassVar[ClipPolicy.Kind]
        PER_LAYER_PROPORTIONAL: _ClassVar[ClipPolicy.Kind]
        PER_LAYER_EXPLICIT: _ClassVar[ClipPolicy.Kind]
    KIND_UNSPECIFIED: ClipPolicy.Kind
    GLOBAL: ClipPolicy.Kind
    PER_LAYER_UNIFORM: ClipPolicy.Kind
    PER_LAYER_PROPORTIONAL: ClipPolicy.Kind
    PER_LAYER_EXPLICIT: ClipPolicy.Kind
    class NonFinite(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NON_FINITE_UNSPECIFIED: _ClassVar[ClipPolicy.NonFinite]
        ZERO_EXAMPLE: _ClassVar[ClipPolicy.NonFinite]
        ZERO_ENTRIES: _ClassVar[ClipPolicy.NonFinite]
        PROPAGATE: _ClassVar[ClipPolicy.NonFinite]
        REJECT: _ClassVar[ClipPolicy.NonFinite]
    NON_FINITE_UNSPECIFIED: ClipPolicy.NonFinite
    ZERO_EXAMPLE: ClipPolicy.NonFinite
    ZERO_ENTRIES: ClipPolicy.NonFinite
    PROPAGATE: ClipPolicy.NonFinite
    REJECT: ClipPolicy.NonFinite
    KIND_FIELD_NUMBER: _ClassVar[int]
    L2_NORM_CLIP_FIELD_NUMBER: _ClassVar[int]
    LAYER_CLIPS_FIELD_NUMBER: _ClassVar[int]
    RESCALE_TO_UNIT_NORM_FIELD_NUMBER: _ClassVar[int]
    NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    kind: ClipPolicy.Kind
    l2_norm_clip: float
    layer_clips: _containers.RepeatedScalarFieldContainer[float]
    rescale_to_unit_norm: bool
    non_finite: ClipPolicy.NonFinite
    def __init__(self, kind: _Optional[_Union[ClipPolicy.Kind, str]] = ..., l2_norm_clip: _Optional[float] = ..., layer_clips: _Optional[_Iterable[float]] = ..., rescale_to_unit_norm: bool = ..., non_finite: _Optional[_Union[ClipPolicy.NonFinite, str]] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("kind", "rate", "population", "sample_size", "drawn_by")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[Sampling.Kind]
        POISSON: _ClassVar[Sampling.Kind]
        FIXED_SIZE: _ClassVar[Sampling.Kind]
    NONE: Sampling.Kind
    POISSON: Sampling.Kind
    FIXED_SIZE: Sampling.Kind
    class DrawnBy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CALLER: _ClassVar[Sampling.DrawnBy]
        SERVER: _ClassVar[Sampling.DrawnBy]
    CALLER: Sampling.DrawnBy
    SERVER: Sampling.DrawnBy
    KIND_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    POPULATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAWN_BY_FIELD_NUMBER: _ClassVar[int]
    kind: Sampling.Kind
    rate: float
    population: int
    sample_size: int
    drawn_by: Sampling.DrawnBy
    def __init__(self, kind: _Optional[_Union[Sampling.Kind, str]] = ..., rate: _Optional[float] = ..., population: _Optional[int] = ..., sample_size: _Optional[int] = ..., drawn_by: _Optional[_Union[Sampling.DrawnBy, str]] = ...) -> None: ...

class AdaptiveClipping(_message.Message):
    __slots__ = ("target_unclipped_quantile", "learning_rate", "count_stddev", "initial_bound", "min_bound", "max_bound", "arithmetic_update")
    TARGET_UNCLIPPED_QUANTILE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    COUNT_STDDEV_FIELD_NUMBER: _ClassVar[int]
    INITIAL_BOUND_FIELD_NUMBER: _ClassVar[int]
    MIN_BOUND_FIELD_NUMBER: _ClassVar[int]
    MAX_BOUND_FIELD_NUMBER: _ClassVar[int]
    ARITHMETIC_UPDATE_FIELD_NUMBER: _ClassVar[int]
    target_unclipped_quantile: float
    learning_rate: float
    count_stddev: float
    initial_bound: float
    min_bound: float
    max_bound: float
    arithmetic_update: bool
    def __init__(self, target_unclipped_quantile: _Optional[float] = ..., learning_rate: _Optional[float] = ..., count_stddev: _Optional[float] = ..., initial_bound: _Optional[float] = ..., min_bound: _Optional[float] = ..., max_bound: _Optional[float] = ..., arithmetic_update: bool = ...) -> None: ...

class PrivacyPolicy(_message.Message):
    __slots__ = ("ledger_id", "delta", "noise_multiplier", "target_epsilon", "planned_releases", "neighbouring", "sampling", "accountant", "max_epsilon", "adaptive", "public_denominator", "release_mean", "metrics_noise_multiplier", "seed", "debug_raw_statistics", "noise", "correlated", "audit", "participation")
    class Neighbouring(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ADD_REMOVE_ONE: _ClassVar[PrivacyPolicy.Neighbouring]
        REPLACE_ONE: _ClassVar[PrivacyPolicy.Neighbouring]
    ADD_REMOVE_ONE: PrivacyPolicy.Neighbouring
    REPLACE_ONE: PrivacyPolicy.Neighbouring
    class Accountant(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RDP: _ClassVar[PrivacyPolicy.Accountant]
        PLD: _ClassVar[PrivacyPolicy.Accountant]
        ZCDP: _ClassVar[PrivacyPolicy.Accountant]
    RDP: PrivacyPolicy.Accountant
    PLD: PrivacyPolicy.Accountant
    ZCDP: PrivacyPolicy.Accountant
    class Noise(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        GAUSSIAN: _ClassVar[PrivacyPolicy.Noise]
        SECURE: _ClassVar[PrivacyPolicy.Noise]
    GAUSSIAN: PrivacyPolicy.Noise
    SECURE: PrivacyPolicy.Noise
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    TARGET_EPSILON_FIELD_NUMBER: _ClassVar[int]
    PLANNED_RELEASES_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURING_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    MAX_EPSILON_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_DENOMINATOR_FIELD_NUMBER: _ClassVar[int]
    RELEASE_MEAN_FIELD_NUMBER: _ClassVar[int]
    METRICS_NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DEBUG_RAW_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    NOISE_FIELD_NUMBER: _ClassVar[int]
    CORRELATED_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    PARTICIPATION_FIELD_NUMBER: _ClassVar[int]
    ledger_id: str
    delta: float
    noise_multiplier: float
    target_epsilon: float
    planned_releases: int
    neighbouring: PrivacyPolicy.Neighbouring
    sampling: Sampling
    accountant: PrivacyPolicy.Accountant
    max_epsilon: float
    adaptive: AdaptiveClipping
    public_denominator: float
    release_mean: bool
    metrics_noise_multiplier: float
    seed: int
    debug_raw_statistics: bool
    noise: PrivacyPolicy.Noise
    correlated: CorrelatedNoise
    audit: CanaryAudit
    participation: Participation
    def __init__(self, ledger_id: _Optional[str] = ..., delta: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., target_epsilon: _Optional[float] = ..., planned_releases: _Optional[int] = ..., neighbouring: _Optional[_Union[PrivacyPolicy.Neighbouring, str]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., accountant: _Optional[_Union[PrivacyPolicy.Accountant, str]] = ..., max_epsilon: _Optional[float] = ..., adaptive: _Optional[_Union[AdaptiveClipping, _Mapping]] = ..., public_denominator: _Optional[float] = ..., release_mean: bool = ..., metrics_noise_multiplier: _Optional[float] = ..., seed: _Optional[int] = ..., debug_raw_statistics: bool = ..., noise: _Optional[_Union[PrivacyPolicy.Noise, str]] = ..., correlated: _Optional[_Union[CorrelatedNoise, _Mapping]] = ..., audit: _Optional[_Union[CanaryAudit, _Mapping]] = ..., participation: _Optional[_Union[Participation, _Mapping]] = ...) -> None: ...

class Participation(_message.Message):
    __slots__ = ("min_separation", "max_participations")
    MIN_SEPARATION_FIELD_NUMBER: _ClassVar[int]
    MAX_PARTICIPATIONS_FIELD_NUMBER: _ClassVar[int]
    min_separation: int
    max_participations: int
    def __init__(self, min_separation: _Optional[int] = ..., max_participations: _Optional[int] = ...) -> None: ...

class CanaryAudit(_message.Message):
    __slots__ = ("canaries", "confidence")
    CANARIES_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    canaries: int
    confidence: float
    def __init__(self, canaries: _Optional[int] = ..., confidence: _Optional[float] = ...) -> None: ...

class CorrelatedNoise(_message.Message):
    __slots__ = ("mechanism", "releases", "min_separation", "max_participations", "buffers", "declared", "strategy")
    class Mechanism(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MECHANISM_UNSPECIFIED: _ClassVar[CorrelatedNoise.Mechanism]
        BLT: _ClassVar[CorrelatedNoise.Mechanism]
        BANDED: _ClassVar[CorrelatedNoise.Mechanism]
    MECHANISM_UNSPECIFIED: CorrelatedNoise.Mechanism
    BLT: CorrelatedNoise.Mechanism
    BANDED: CorrelatedNoise.Mechanism
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    MIN_SEPARATION_FIELD_NUMBER: _ClassVar[int]
    MAX_PARTICIPATIONS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    DECLARED_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    mechanism: CorrelatedNoise.Mechanism
    releases: int
    min_separation: int
    max_participations: int
    buffers: int
    declared: bool
    strategy: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, mechanism: _Optional[_Union[CorrelatedNoise.Mechanism, str]] = ..., releases: _Optional[int] = ..., min_separation: _Optional[int] = ..., max_participations: _Optional[int] = ..., buffers: _Optional[int] = ..., declared: bool = ..., strategy: _Optional[_Iterable[float]] = ...) -> None: ...

class CreateAggregationRequest(_message.Message):
    __slots__ = ("layers", "policy", "aggregation_id", "privacy", "unit", "self_asserted_client_ids")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    SELF_ASSERTED_CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    policy: ClipPolicy
    aggregation_id: str
    privacy: PrivacyPolicy
    unit: PrivacyUnit
    self_asserted_client_ids: bool
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., policy: _Optional[_Union[ClipPolicy, _Mapping]] = ..., aggregation_id: _Optional[str] = ..., privacy: _Optional[_Union[PrivacyPolicy, _Mapping]] = ..., unit: _Optional[_Union[PrivacyUnit, str]] = ..., self_asserted_client_ids: bool = ...) -> None: ...

class Aggregation(_message.Message):
    __slots__ = ("aggregation_id", "layers", "policy", "state", "layer_bounds", "examples", "created_unix_seconds", "failure_reason", "submit_token", "privacy", "planned_ledger_epsilon", "unit", "client_ids", "placement")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[Aggregation.State]
        WARMING_UP: _ClassVar[Aggregation.State]
        OPEN: _ClassVar[Aggregation.State]
        FINALIZED: _ClassVar[Aggregation.State]
        CANCELLED: _ClassVar[Aggregation.State]
        FAILED: _ClassVar[Aggregation.State]
    STATE_UNSPECIFIED: Aggregation.State
    WARMING_UP: Aggregation.State
    OPEN: Aggregation.State
    FINALIZED: Aggregation.State
    CANCELLED: Aggregation.State
    FAILED: Aggregation.State
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAYER_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    PLANNED_LEDGER_EPSILON_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    policy: ClipPolicy
    state: Aggregation.State
    layer_bounds: _containers.RepeatedScalarFieldContainer[float]
    examples: int
    created_unix_seconds: float
    failure_reason: str
    submit_token: str
    privacy: PrivacyPolicy
    planned_ledger_epsilon: float
    unit: PrivacyUnit
    client_ids: str
    placement: Placement
    def __init__(self, aggregation_id: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., policy: _Optional[_Union[ClipPolicy, _Mapping]] = ..., state: _Optional[_Union[Aggregation.State, str]] = ..., layer_bounds: _Optional[_Iterable[float]] = ..., examples: _Optional[int] = ..., created_unix_seconds: _Optional[float] = ..., failure_reason: _Optional[str] = ..., submit_token: _Optional[str] = ..., privacy: _Optional[_Union[PrivacyPolicy, _Mapping]] = ..., planned_ledger_epsilon: _Optional[float] = ..., unit: _Optional[_Union[PrivacyUnit, str]] = ..., client_ids: _Optional[str] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("layer", "dtype", "shape", "offset", "data")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer: int
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, layer: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("aggregation_id", "client_id", "sequence", "chunks", "writer_id", "resume")
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    WRITER_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    client_id: str
    sequence: int
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    writer_id: str
    resume: bool
    def __init__(self, aggregation_id: _Optional[str] = ..., client_id: _Optional[str] = ..., sequence: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., writer_id: _Optional[str] = ..., resume: bool = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("acknowledged_sequence", "aggregation_examples", "accepted_sequence", "writer_id", "received_bytes", "summed_sequence", "partial_sequence", "partial_bytes", "client_id")
    ACKNOWLEDGED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    WRITER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SUMMED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    acknowledged_sequence: int
    aggregation_examples: int
    accepted_sequence: int
    writer_id: str
    received_bytes: int
    summed_sequence: int
    partial_sequence: int
    partial_bytes: _containers.RepeatedScalarFieldContainer[int]
    client_id: str
    def __init__(self, acknowledged_sequence: _Optional[int] = ..., aggregation_examples: _Optional[int] = ..., accepted_sequence: _Optional[int] = ..., writer_id: _Optional[str] = ..., received_bytes: _Optional[int] = ..., summed_sequence: _Optional[int] = ..., partial_sequence: _Optional[int] = ..., partial_bytes: _Optional[_Iterable[int]] = ..., client_id: _Optional[str] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ("aggregation_id",)
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    def __init__(self, aggregation_id: _Optional[str] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("aggregation_id", "shards", "endpoints")
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    shards: int
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aggregation_id: _Optional[str] = ..., shards: _Optional[int] = ..., endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class GetAggregationRequest(_message.Message):
    __slots__ = ("aggregation_id",)
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    def __init__(self, aggregation_id: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("aggregation_id",)
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    def __init__(self, aggregation_id: _Optional[str] = ...) -> None: ...

class LayerStats(_message.Message):
    __slots__ = ("name", "bound", "clipped", "norm_mean", "norm_max", "norm_histogram")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    NORM_MEAN_FIELD_NUMBER: _ClassVar[int]
    NORM_MAX_FIELD_NUMBER: _ClassVar[int]
    NORM_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    name: str
    bound: float
    clipped: int
    norm_mean: float
    norm_max: float
    norm_histogram: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., bound: _Optional[float] = ..., clipped: _Optional[int] = ..., norm_mean: _Optional[float] = ..., norm_max: _Optional[float] = ..., norm_histogram: _Optional[_Iterable[int]] = ...) -> None: ...

class AggregationStats(_message.Message):
    __slots__ = ("aggregation_id", "state", "examples", "batches", "bytes", "non_finite", "clipped", "layers", "bucket_upper_bounds", "example_norm_histogram", "example_bound", "updated_unix_seconds", "examples_per_second", "failure_reason", "privacy_notice", "release")
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_UPPER_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_NORM_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_BOUND_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_NOTICE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    state: Aggregation.State
    examples: int
    batches: int
    bytes: int
    non_finite: int
    clipped: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerStats]
    bucket_upper_bounds: _containers.RepeatedScalarFieldContainer[float]
    example_norm_histogram: _containers.RepeatedScalarFieldContainer[int]
    example_bound: float
    updated_unix_seconds: float
    examples_per_second: float
    failure_reason: str
    privacy_notice: str
    release: Release
    def __init__(self, aggregation_id: _Optional[str] = ..., state: _Optional[_Union[Aggregation.State, str]] = ..., examples: _Optional[int] = ..., batches: _Optional[int] = ..., bytes: _Optional[int] = ..., non_finite: _Optional[int] = ..., clipped: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerStats, _Mapping]]] = ..., bucket_upper_bounds: _Optional[_Iterable[float]] = ..., example_norm_histogram: _Optional[_Iterable[int]] = ..., example_bound: _Optional[float] = ..., updated_unix_seconds: _Optional[float] = ..., examples_per_second: _Optional[float] = ..., failure_reason: _Optional[str] = ..., privacy_notice: _Optional[str] = ..., release: _Optional[_Union[Release, _Mapping]] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("ledger_id", "noise_multiplier", "value_noise_multiplier", "sensitivity", "noise_stddev", "bound", "next_bound", "epsilon", "ledger_epsilon", "delta", "budget_left", "dp_event_json", "seeded", "mean", "denominator", "ledger_releases", "unclipped_fraction", "debug_raw_statistics", "statistics_noise_stddev", "example_norm_histogram", "layer_clipped", "examples", "grid_step", "grid_noise_scale", "mechanism", "stream_release", "stream_releases", "unit", "client_ids", "stream_noise_stddev", "stream", "sampling", "sampling_rate", "sampling_drawn_by", "stream_id", "stream_version", "contributions", "staleness")
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    VALUE_NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    SENSITIVITY_FIELD_NUMBER: _ClassVar[int]
    NOISE_STDDEV_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    NEXT_BOUND_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    LEDGER_EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BUDGET_LEFT_FIELD_NUMBER: _ClassVar[int]
    DP_EVENT_JSON_FIELD_NUMBER: _ClassVar[int]
    SEEDED_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    DENOMINATOR_FIELD_NUMBER: _ClassVar[int]
    LEDGER_RELEASES_FIELD_NUMBER: _ClassVar[int]
    UNCLIPPED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    DEBUG_RAW_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_NOISE_STDDEV_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_NORM_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    LAYER_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    GRID_STEP_FIELD_NUMBER: _ClassVar[int]
    GRID_NOISE_SCALE_FIELD_NUMBER: _ClassVar[int]
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    STREAM_RELEASE_FIELD_NUMBER: _ClassVar[int]
    STREAM_RELEASES_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_NOISE_STDDEV_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_RATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DRAWN_BY_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    ledger_id: str
    noise_multiplier: float
    value_noise_multiplier: float
    sensitivity: float
    noise_stddev: float
    bound: float
    next_bound: float
    epsilon: float
    ledger_epsilon: float
    delta: float
    budget_left: float
    dp_event_json: str
    seeded: bool
    mean: bool
    denominator: float
    ledger_releases: int
    unclipped_fraction: float
    debug_raw_statistics: bool
    statistics_noise_stddev: float
    example_norm_histogram: _containers.RepeatedScalarFieldContainer[float]
    layer_clipped: _containers.RepeatedScalarFieldContainer[float]
    examples: float
    grid_step: float
    grid_noise_scale: float
    mechanism: str
    stream_release: int
    stream_releases: int
    unit: PrivacyUnit
    client_ids: str
    stream_noise_stddev: float
    stream: CorrelatedNoise
    sampling: str
    sampling_rate: float
    sampling_drawn_by: str
    stream_id: str
    stream_version: int
    contributions: int
    staleness: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ledger_id: _Optional[str] = ..., noise_multiplier: _Optional[float] = ..., value_noise_multiplier: _Optional[float] = ..., sensitivity: _Optional[float] = ..., noise_stddev: _Optional[float] = ..., bound: _Optional[float] = ..., next_bound: _Optional[float] = ..., epsilon: _Optional[float] = ..., ledger_epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., budget_left: _Optional[float] = ..., dp_event_json: _Optional[str] = ..., seeded: bool = ..., mean: bool = ..., denominator: _Optional[float] = ..., ledger_releases: _Optional[int] = ..., unclipped_fraction: _Optional[float] = ..., debug_raw_statistics: bool = ..., statistics_noise_stddev: _Optional[float] = ..., example_norm_histogram: _Optional[_Iterable[float]] = ..., layer_clipped: _Optional[_Iterable[float]] = ..., examples: _Optional[float] = ..., grid_step: _Optional[float] = ..., grid_noise_scale: _Optional[float] = ..., mechanism: _Optional[str] = ..., stream_release: _Optional[int] = ..., stream_releases: _Optional[int] = ..., unit: _Optional[_Union[PrivacyUnit, str]] = ..., client_ids: _Optional[str] = ..., stream_noise_stddev: _Optional[float] = ..., stream: _Optional[_Union[CorrelatedNoise, _Mapping]] = ..., sampling: _Optional[str] = ..., sampling_rate: _Optional[float] = ..., sampling_drawn_by: _Optional[str] = ..., stream_id: _Optional[str] = ..., stream_version: _Optional[int] = ..., contributions: _Optional[int] = ..., staleness: _Optional[_Iterable[int]] = ...) -> None: ...

class GetLedgerRequest(_message.Message):
    __slots__ = ("ledger_id",)
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    ledger_id: str
    def __init__(self, ledger_id: _Optional[str] = ...) -> None: ...

class CloseAuditRequest(_message.Message):
    __slots__ = ("ledger_id",)
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    ledger_id: str
    def __init__(self, ledger_id: _Optional[str] = ...) -> None: ...

class LedgerAudit(_message.Message):
    __slots__ = ("canaries", "confidence", "closed", "releases", "epsilon_claimed", "epsilon_lower", "epsilon_ceiling", "method", "refuted", "in_scores", "out_scores", "seed")
    CANARIES_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    EPSILON_CLAIMED_FIELD_NUMBER: _ClassVar[int]
    EPSILON_LOWER_FIELD_NUMBER: _ClassVar[int]
    EPSILON_CEILING_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REFUTED_FIELD_NUMBER: _ClassVar[int]
    IN_SCORES_FIELD_NUMBER: _ClassVar[int]
    OUT_SCORES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    canaries: int
    confidence: float
    closed: bool
    releases: int
    epsilon_claimed: float
    epsilon_lower: float
    epsilon_ceiling: float
    method: str
    refuted: bool
    in_scores: _containers.RepeatedScalarFieldContainer[float]
    out_scores: _containers.RepeatedScalarFieldContainer[float]
    seed: int
    def __init__(self, canaries: _Optional[int] = ..., confidence: _Optional[float] = ..., closed: bool = ..., releases: _Optional[int] = ..., epsilon_claimed: _Optional[float] = ..., epsilon_lower: _Optional[float] = ..., epsilon_ceiling: _Optional[float] = ..., method: _Optional[str] = ..., refuted: bool = ..., in_scores: _Optional[_Iterable[float]] = ..., out_scores: _Optional[_Iterable[float]] = ..., seed: _Optional[int] = ...) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("aggregation_id", "dp_event_json", "epsilon_after", "unix_seconds", "next_bound")
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    DP_EVENT_JSON_FIELD_NUMBER: _ClassVar[int]
    EPSILON_AFTER_FIELD_NUMBER: _ClassVar[int]
    UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_BOUND_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    dp_event_json: str
    epsilon_after: float
    unix_seconds: float
    next_bound: float
    def __init__(self, aggregation_id: _Optional[str] = ..., dp_event_json: _Optional[str] = ..., epsilon_after: _Optional[float] = ..., unix_seconds: _Optional[float] = ..., next_bound: _Optional[float] = ...) -> None: ...

class Ledger(_message.Message):
    __slots__ = ("ledger_id", "accountant", "neighbouring", "delta", "max_epsilon", "epsilon", "budget_left", "entries", "next_bound", "debug_raw_statistics", "mechanism", "stream", "stream_made", "stream_state_rows", "stream_state_bytes", "unit", "client_ids", "audit", "sampling_drawn_by")
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURING_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    MAX_EPSILON_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    BUDGET_LEFT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_BOUND_FIELD_NUMBER: _ClassVar[int]
    DEBUG_RAW_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    STREAM_MADE_FIELD_NUMBER: _ClassVar[int]
    STREAM_STATE_ROWS_FIELD_NUMBER: _ClassVar[int]
    STREAM_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DRAWN_BY_FIELD_NUMBER: _ClassVar[int]
    ledger_id: str
    accountant: str
    neighbouring: str
    delta: float
    max_epsilon: float
    epsilon: float
    budget_left: float
    entries: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    next_bound: float
    debug_raw_statistics: bool
    mechanism: str
    stream: CorrelatedNoise
    stream_made: int
    stream_state_rows: int
    stream_state_bytes: int
    unit: PrivacyUnit
    client_ids: str
    audit: LedgerAudit
    sampling_drawn_by: str
    def __init__(self, ledger_id: _Optional[str] = ..., accountant: _Optional[str] = ..., neighbouring: _Optional[str] = ..., delta: _Optional[float] = ..., max_epsilon: _Optional[float] = ..., epsilon: _Optional[float] = ..., budget_left: _Optional[float] = ..., entries: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ..., next_bound: _Optional[float] = ..., debug_raw_statistics: bool = ..., mechanism: _Optional[str] = ..., stream: _Optional[_Union[CorrelatedNoise, _Mapping]] = ..., stream_made: _Optional[int] = ..., stream_state_rows: _Optional[int] = ..., stream_state_bytes: _Optional[int] = ..., unit: _Optional[_Union[PrivacyUnit, str]] = ..., client_ids: _Optional[str] = ..., audit: _Optional[_Union[LedgerAudit, _Mapping]] = ..., sampling_drawn_by: _Optional[str] = ...) -> None: ...

class DrawClientsRequest(_message.Message):
    __slots__ = ("aggregation_id", "client_ids")
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    client_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aggregation_id: _Optional[str] = ..., client_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DrawClientsResponse(_message.Message):
    __slots__ = ("aggregation_id", "ledger_id", "release", "sampling_rate", "drawn_client_ids")
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_RATE_FIELD_NUMBER: _ClassVar[int]
    DRAWN_CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    ledger_id: str
    release: int
    sampling_rate: float
    drawn_client_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aggregation_id: _Optional[str] = ..., ledger_id: _Optional[str] = ..., release: _Optional[int] = ..., sampling_rate: _Optional[float] = ..., drawn_client_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("aggregation", "gradients", "previous_id")
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ID_FIELD_NUMBER: _ClassVar[int]
    aggregation: CreateAggregationRequest
    gradients: SubmitRequest
    previous_id: str
    def __init__(self, aggregation: _Optional[_Union[CreateAggregationRequest, _Mapping]] = ..., gradients: _Optional[_Union[SubmitRequest, _Mapping]] = ..., previous_id: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("stats", "sums")
    STATS_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    stats: AggregationStats
    sums: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, stats: _Optional[_Union[AggregationStats, _Mapping]] = ..., sums: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class FinalizeRequest(_message.Message):
    __slots__ = ("aggregation_id", "max_chunk_bytes")
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    max_chunk_bytes: int
    def __init__(self, aggregation_id: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class FinalizeResponse(_message.Message):
    __slots__ = ("stats", "sum")
    STATS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    stats: AggregationStats
    sum: TensorChunk
    def __init__(self, stats: _Optional[_Union[AggregationStats, _Mapping]] = ..., sum: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class ListAggregationsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAggregationsResponse(_message.Message):
    __slots__ = ("aggregations",)
    AGGREGATIONS_FIELD_NUMBER: _ClassVar[int]
    aggregations: _containers.RepeatedCompositeFieldContainer[Aggregation]
    def __init__(self, aggregations: _Optional[_Iterable[_Union[Aggregation, _Mapping]]] = ...) -> None: ...

class CancelAggregationRequest(_message.Message):
    __slots__ = ("aggregation_id",)
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    def __init__(self, aggregation_id: _Optional[str] = ...) -> None: ...

class IssueClientTokenRequest(_message.Message):
    __slots__ = ("aggregation_id", "ledger_id", "client_id", "role", "ttl_seconds")
    class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CLIENT: _ClassVar[IssueClientTokenRequest.Role]
        SUBMITTER: _ClassVar[IssueClientTokenRequest.Role]
    CLIENT: IssueClientTokenRequest.Role
    SUBMITTER: IssueClientTokenRequest.Role
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    ledger_id: str
    client_id: str
    role: IssueClientTokenRequest.Role
    ttl_seconds: float
    def __init__(self, aggregation_id: _Optional[str] = ..., ledger_id: _Optional[str] = ..., client_id: _Optional[str] = ..., role: _Optional[_Union[IssueClientTokenRequest.Role, str]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class ClientToken(_message.Message):
    __slots__ = ("token", "client_id", "aggregation_id", "ledger_id", "role", "expires_unix_seconds")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token: str
    client_id: str
    aggregation_id: str
    ledger_id: str
    role: IssueClientTokenRequest.Role
    expires_unix_seconds: float
    def __init__(self, token: _Optional[str] = ..., client_id: _Optional[str] = ..., aggregation_id: _Optional[str] = ..., ledger_id: _Optional[str] = ..., role: _Optional[_Union[IssueClientTokenRequest.Role, str]] = ..., expires_unix_seconds: _Optional[float] = ...) -> None: ...

class BufferPolicy(_message.Message):
    __slots__ = ("size", "staleness_exponent", "max_staleness", "max_wait_seconds", "min_size", "keep_versions")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_EXPONENT_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    KEEP_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    size: int
    staleness_exponent: float
    max_staleness: int
    max_wait_seconds: float
    min_size: int
    keep_versions: int
    def __init__(self, size: _Optional[int] = ..., staleness_exponent: _Optional[float] = ..., max_staleness: _Optional[int] = ..., max_wait_seconds: _Optional[float] = ..., min_size: _Optional[int] = ..., keep_versions: _Optional[int] = ...) -> None: ...

class CreateStreamRequest(_message.Message):
    __slots__ = ("stream_id", "layers", "policy", "privacy", "buffer")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    policy: ClipPolicy
    privacy: PrivacyPolicy
    buffer: BufferPolicy
    def __init__(self, stream_id: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., policy: _Optional[_Union[ClipPolicy, _Mapping]] = ..., privacy: _Optional[_Union[PrivacyPolicy, _Mapping]] = ..., buffer: _Optional[_Union[BufferPolicy, _Mapping]] = ...) -> None: ...

class BufferedStream(_message.Message):
    __slots__ = ("stream_id", "layers", "policy", "privacy", "buffer", "version", "filling", "state", "reason", "created_unix_seconds", "releases_per_minute", "ledger_epsilon")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FILLING_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    LEDGER_EPSILON_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    policy: ClipPolicy
    privacy: PrivacyPolicy
    buffer: BufferPolicy
    version: int
    filling: int
    state: str
    reason: str
    created_unix_seconds: float
    releases_per_minute: float
    ledger_epsilon: float
    def __init__(self, stream_id: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., policy: _Optional[_Union[ClipPolicy, _Mapping]] = ..., privacy: _Optional[_Union[PrivacyPolicy, _Mapping]] = ..., buffer: _Optional[_Union[BufferPolicy, _Mapping]] = ..., version: _Optional[int] = ..., filling: _Optional[int] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., created_unix_seconds: _Optional[float] = ..., releases_per_minute: _Optional[float] = ..., ledger_epsilon: _Optional[float] = ...) -> None: ...

class GetStreamRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    def __init__(self, stream_id: _Optional[str] = ...) -> None: ...

class StopStreamRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    def __init__(self, stream_id: _Optional[str] = ...) -> None: ...

class StreamSubmitRequest(_message.Message):
    __slots__ = ("stream_id", "client_id", "sequence", "trained_from", "chunks")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FROM_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    client_id: str
    sequence: int
    trained_from: int
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, stream_id: _Optional[str] = ..., client_id: _Optional[str] = ..., sequence: _Optional[int] = ..., trained_from: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class StreamSubmitResponse(_message.Message):
    __slots__ = ("client_id", "sequence", "version", "staleness", "weight", "duplicate")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    sequence: int
    version: int
    staleness: int
    weight: float
    duplicate: bool
    def __init__(self, client_id: _Optional[str] = ..., sequence: _Optional[int] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., weight: _Optional[float] = ..., duplicate: bool = ...) -> None: ...

class GetStreamClientRequest(_message.Message):
    __slots__ = ("stream_id", "client_id")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    client_id: str
    def __init__(self, stream_id: _Optional[str] = ..., client_id: _Optional[str] = ...) -> None: ...

class StreamClient(_message.Message):
    __slots__ = ("client_id", "contributions", "next_sequence", "versions", "may_contribute_from")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MAY_CONTRIBUTE_FROM_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    contributions: int
    next_sequence: int
    versions: _containers.RepeatedScalarFieldContainer[int]
    may_contribute_from: int
    def __init__(self, client_id: _Optional[str] = ..., contributions: _Optional[int] = ..., next_sequence: _Optional[int] = ..., versions: _Optional[_Iterable[int]] = ..., may_contribute_from: _Optional[int] = ...) -> None: ...

class WatchReleasesRequest(_message.Message):
    __slots__ = ("stream_id", "after_version", "max_chunk_bytes")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    after_version: int
    max_chunk_bytes: int
    def __init__(self, stream_id: _Optional[str] = ..., after_version: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class GetStreamReleaseRequest(_message.Message):
    __slots__ = ("stream_id", "version", "max_chunk_bytes")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    version: int
    max_chunk_bytes: int
    def __init__(self, stream_id: _Optional[str] = ..., version: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class StreamReleasePart(_message.Message):
    __slots__ = ("release", "sum", "chunks")
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    release: Release
    sum: TensorChunk
    chunks: int
    def __init__(self, release: _Optional[_Union[Release, _Mapping]] = ..., sum: _Optional[_Union[TensorChunk, _Mapping]] = ..., chunks: _Optional[int] = ...) -> None: ...
