from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AvgMember(_message.Message):
    __slots__ = ("peer_id", "addr", "weight", "bandwidth", "client_mode", "auxiliary")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODE_FIELD_NUMBER: _ClassVar[int]
    AUXILIARY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    addr: str
    weight: float
    bandwidth: float
    client_mode: bool
    auxiliary: bool
    def __init__(self, peer_id: _Optional[str] = ..., addr: _Optional[str] = ..., weight: _Optional[float] = ..., bandwidth: _Optional[float] = ..., client_mode: bool = ..., auxiliary: bool = ...) -> None: ...

class AvgGroup(_message.Message):
    __slots__ = ("round_id", "prefix", "members", "timeout", "numel", "compression", "chunk_bytes", "schema")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    round_id: bytes
    prefix: str
    members: _containers.RepeatedCompositeFieldContainer[AvgMember]
    timeout: float
    numel: int
    compression: int
    chunk_bytes: int
    schema: bytes
    def __init__(self, round_id: _Optional[bytes] = ..., prefix: _Optional[str] = ..., members: _Optional[_Iterable[_Union[AvgMember, _Mapping]]] = ..., timeout: _Optional[float] = ..., numel: _Optional[int] = ..., compression: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., schema: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("prefix", "group_key", "schema", "numel", "member", "timeout", "excludes")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDES_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    group_key: str
    schema: bytes
    numel: int
    member: AvgMember
    timeout: float
    excludes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prefix: _Optional[str] = ..., group_key: _Optional[str] = ..., schema: _Optional[bytes] = ..., numel: _Optional[int] = ..., member: _Optional[_Union[AvgMember, _Mapping]] = ..., timeout: _Optional[float] = ..., excludes: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("accepted", "reason", "group", "started_group_key")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STARTED_GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    group: AvgGroup
    started_group_key: str
    def __init__(self, accepted: bool = ..., reason: _Optional[str] = ..., group: _Optional[_Union[AvgGroup, _Mapping]] = ..., started_group_key: _Optional[str] = ...) -> None: ...

class ReduceHeader(_message.Message):
    __slots__ = ("prefix", "round_id", "part", "sender", "numel", "has_data")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    HAS_DATA_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    round_id: bytes
    part: int
    sender: int
    numel: int
    has_data: bool
    def __init__(self, prefix: _Optional[str] = ..., round_id: _Optional[bytes] = ..., part: _Optional[int] = ..., sender: _Optional[int] = ..., numel: _Optional[int] = ..., has_data: bool = ...) -> None: ...

class SenderAck(_message.Message):
    __slots__ = ("part", "reason")
    PART_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    part: int
    reason: str
    def __init__(self, part: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReduceReport(_message.Message):
    __slots__ = ("prefix", "round_id", "part", "ok_senders", "failed_senders", "failed_reasons")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    OK_SENDERS_FIELD_NUMBER: _ClassVar[int]
    FAILED_SENDERS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REASONS_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    round_id: bytes
    part: int
    ok_senders: _containers.RepeatedScalarFieldContainer[int]
    failed_senders: _containers.RepeatedScalarFieldContainer[int]
    failed_reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prefix: _Optional[str] = ..., round_id: _Optional[bytes] = ..., part: _Optional[int] = ..., ok_senders: _Optional[_Iterable[int]] = ..., failed_senders: _Optional[_Iterable[int]] = ..., failed_reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("round_id", "abort", "reason", "contributors", "weights", "excluded", "excluded_reasons")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_REASONS_FIELD_NUMBER: _ClassVar[int]
    round_id: bytes
    abort: bool
    reason: str
    contributors: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    excluded: _containers.RepeatedScalarFieldContainer[int]
    excluded_reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round_id: _Optional[bytes] = ..., abort: bool = ..., reason: _Optional[str] = ..., contributors: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ..., excluded: _Optional[_Iterable[int]] = ..., excluded_reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class ResultHeader(_message.Message):
    __slots__ = ("abort", "reason", "decision", "part", "compression", "clip_scales", "clip_tau", "clip_step", "digest", "sketches", "distances")
    ABORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    CLIP_SCALES_FIELD_NUMBER: _ClassVar[int]
    CLIP_TAU_FIELD_NUMBER: _ClassVar[int]
    CLIP_STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SKETCHES_FIELD_NUMBER: _ClassVar[int]
    DISTANCES_FIELD_NUMBER: _ClassVar[int]
    abort: bool
    reason: str
    decision: bytes
    part: int
    compression: int
    clip_scales: _containers.RepeatedScalarFieldContainer[float]
    clip_tau: float
    clip_step: float
    digest: bytes
    sketches: _containers.RepeatedScalarFieldContainer[float]
    distances: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, abort: bool = ..., reason: _Optional[str] = ..., decision: _Optional[bytes] = ..., part: _Optional[int] = ..., compression: _Optional[int] = ..., clip_scales: _Optional[_Iterable[float]] = ..., clip_tau: _Optional[float] = ..., clip_step: _Optional[float] = ..., digest: _Optional[bytes] = ..., sketches: _Optional[_Iterable[float]] = ..., distances: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyReport(_message.Message):
    __slots__ = ("prefix", "round_id", "member", "digests", "accused", "reasons")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    ACCUSED_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    round_id: bytes
    member: int
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    accused: _containers.RepeatedScalarFieldContainer[int]
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prefix: _Optional[str] = ..., round_id: _Optional[bytes] = ..., member: _Optional[int] = ..., digests: _Optional[_Iterable[bytes]] = ..., accused: _Optional[_Iterable[int]] = ..., reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifyVerdict(_message.Message):
    __slots__ = ("ok", "accused", "reported_by", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    ACCUSED_FIELD_NUMBER: _ClassVar[int]
    REPORTED_BY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    accused: int
    reported_by: int
    reason: str
    def __init__(self, ok: bool = ..., accused: _Optional[int] = ..., reported_by: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("prefix", "round_id", "part")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    round_id: bytes
    part: int
    def __init__(self, prefix: _Optional[str] = ..., round_id: _Optional[bytes] = ..., part: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("prefix", "version", "offset")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    version: bytes
    offset: int
    def __init__(self, prefix: _Optional[str] = ..., version: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class StateTensor(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("version", "metadata", "tensors", "total_bytes", "offset")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    version: bytes
    metadata: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[StateTensor]
    total_bytes: int
    offset: int
    def __init__(self, version: _Optional[bytes] = ..., metadata: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[StateTensor, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...
