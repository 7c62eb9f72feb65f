from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenRequest(_message.Message):
    __slots__ = ("aggregation_id",)
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    def __init__(self, aggregation_id: _Optional[str] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("aggregation_id", "timeout_seconds")
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    timeout_seconds: float
    def __init__(self, aggregation_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class FinishResponse(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shards: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("aggregation_ids",)
    AGGREGATION_IDS_FIELD_NUMBER: _ClassVar[int]
    aggregation_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aggregation_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ShardStats(_message.Message):
    __slots__ = ("examples", "non_finite", "batches", "bytes", "clip_counts", "layer_histograms", "example_histogram", "norm_sum", "norm_max")
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CLIP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    LAYER_HISTOGRAMS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    NORM_SUM_FIELD_NUMBER: _ClassVar[int]
    NORM_MAX_FIELD_NUMBER: _ClassVar[int]
    examples: int
    non_finite: int
    batches: int
    bytes: int
    clip_counts: _containers.RepeatedScalarFieldContainer[int]
    layer_histograms: _containers.RepeatedScalarFieldContainer[int]
    example_histogram: _containers.RepeatedScalarFieldContainer[int]
    norm_sum: _containers.RepeatedScalarFieldContainer[float]
    norm_max: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, examples: _Optional[int] = ..., non_finite: _Optional[int] = ..., batches: _Optional[int] = ..., bytes: _Optional[int] = ..., clip_counts: _Optional[_Iterable[int]] = ..., layer_histograms: _Optional[_Iterable[int]] = ..., example_histogram: _Optional[_Iterable[int]] = ..., norm_sum: _Optional[_Iterable[float]] = ..., norm_max: _Optional[_Iterable[float]] = ...) -> None: ...

class AggregationStats(_message.Message):
    __slots__ = ("shards", "failure_reason", "clients")
    class ShardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: ShardStats
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[ShardStats, _Mapping]] = ...) -> None: ...
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.MessageMap[int, ShardStats]
    failure_reason: str
    clients: int
    def __init__(self, shards: _Optional[_Mapping[int, ShardStats]] = ..., failure_reason: _Optional[str] = ..., clients: _Optional[int] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("id", "kind", "platform", "steps")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    id: int
    kind: str
    platform: str
    steps: int
    def __init__(self, id: _Optional[int] = ..., kind: _Optional[str] = ..., platform: _Optional[str] = ..., steps: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("aggregations", "devices", "queued_bytes", "queue_depth", "payload_bytes", "load")
    class AggregationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: AggregationStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[AggregationStats, _Mapping]] = ...) -> None: ...
    AGGREGATIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    aggregations: _containers.MessageMap[str, AggregationStats]
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    queued_bytes: int
    queue_depth: int
    payload_bytes: int
    load: Load
    def __init__(self, aggregations: _Optional[_Mapping[str, AggregationStats]] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., queued_bytes: _Optional[int] = ..., queue_depth: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., load: _Optional[_Union[Load, _Mapping]] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("active_streams", "stream_limit", "refused_streams", "buffered_bytes", "buffer_limit", "refused_batches", "rejections", "participation_refusals", "one_message_held", "one_message_limit", "refused_one_message")
    class RejectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ParticipationRefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_LIMIT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_LIMIT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    PARTICIPATION_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    ONE_MESSAGE_HELD_FIELD_NUMBER: _ClassVar[int]
    ONE_MESSAGE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_ONE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    active_streams: int
    stream_limit: int
    refused_streams: int
    buffered_bytes: int
    buffer_limit: int
    refused_batches: int
    rejections: _containers.ScalarMap[str, int]
    participation_refusals: _containers.ScalarMap[str, int]
    one_message_held: int
    one_message_limit: int
    refused_one_message: int
    def __init__(self, active_streams: _Optional[int] = ..., stream_limit: _Optional[int] = ..., refused_streams: _Optional[int] = ..., buffered_bytes: _Optional[int] = ..., buffer_limit: _Optional[int] = ..., refused_batches: _Optional[int] = ..., rejections: _Optional[_Mapping[str, int]] = ..., participation_refusals: _Optional[_Mapping[str, int]] = ..., one_message_held: _Optional[int] = ..., one_message_limit: _Optional[int] = ..., refused_one_message: _Optional[int] = ...) -> None: ...

class ForgetRequest(_message.Message):
    __slots__ = ("aggregation_id",)
    AGGREGATION_ID_FIELD_NUMBER: _ClassVar[int]
    aggregation_id: str
    def __init__(self, aggregation_id: _Optional[str] = ...) -> None: ...

class ForgetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServeRequest(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class ServeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
