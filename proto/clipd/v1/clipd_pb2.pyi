from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
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
    def __init__(self, kind: _Optional[_Union[ClipPolicy.Kind, str]] = ..., l2_norm_clip: _Optional[float] = ..., layer_clips: _Optional[_Iterable[float]] = ..., rescale_to_unit_norm: _Optional[bool] = ..., non_finite: _Optional[_Union[ClipPolicy.NonFinite, str]] = ...) -> None: ...

class CreateAggregationRequest(_message.Message):
    __slots__ = ("layers", "policy", "aggregation_id")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    policy: ClipPolicy
    aggregation_id: str
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., policy: _Optional[_Union[ClipPolicy, _Mapping]] = ..., aggregation_id: _Optional[str] = ...) -> None: ...

class Aggregation(_message.Message):
    __slots__ = ("aggregation_id", "layers", "policy", "state", "layer_bounds", "examples", "created_unix_seconds", "failure_reason", "submit_token")
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
    aggregation_id: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    policy: ClipPolicy
    state: Aggregation.State
    layer_bounds: _containers.RepeatedScalarFieldContainer[float]
    examples: int
    created_unix_seconds: float
    failure_reason: str
    submit_token: str
    def __init__(self, aggregation_id: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., policy: _Optional[_Union[ClipPolicy, _Mapping]] = ..., state: _Optional[_Union[Aggregation.State, str]] = ..., layer_bounds: _Optional[_Iterable[float]] = ..., examples: _Optional[int] = ..., created_unix_seconds: _Optional[float] = ..., failure_reason: _Optional[str] = ..., submit_token: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("aggregation_id", "client_id", "sequence", "chunks", "writer_id")
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    WRITER_ID_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    client_id: str
    sequence: int
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    writer_id: str
    def __init__(self, aggregation_id: _Optional[str] = ..., client_id: _Optional[str] = ..., sequence: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., writer_id: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("acknowledged_sequence", "aggregation_examples", "accepted_sequence", "writer_id")
    ACKNOWLEDGED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    WRITER_ID_FIELD_NUMBER: _ClassVar[int]
    acknowledged_sequence: int
    aggregation_examples: int
    accepted_sequence: int
    writer_id: str
    def __init__(self, acknowledged_sequence: _Optional[int] = ..., aggregation_examples: _Optional[int] = ..., accepted_sequence: _Optional[int] = ..., writer_id: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("aggregation_id", "state", "examples", "batches", "bytes", "non_finite", "clipped", "layers", "bucket_upper_bounds", "example_norm_histogram", "example_bound", "updated_unix_seconds", "examples_per_second", "failure_reason")
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
    def __init__(self, aggregation_id: _Optional[str] = ..., state: _Optional[_Union[Aggregation.State, str]] = ..., examples: _Optional[int] = ..., batches: _Optional[int] = ..., bytes: _Optional[int] = ..., non_finite: _Optional[int] = ..., clipped: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerStats, _Mapping]]] = ..., bucket_upper_bounds: _Optional[_Iterable[float]] = ..., example_norm_histogram: _Optional[_Iterable[int]] = ..., example_bound: _Optional[float] = ..., updated_unix_seconds: _Optional[float] = ..., examples_per_second: _Optional[float] = ..., failure_reason: _Optional[str] = ...) -> None: ...

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
