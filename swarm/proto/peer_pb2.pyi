from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("peer_id", "version", "addrs", "role", "client_mode", "time", "experts", "reachability", "relays", "started", "links", "runs", "expert_load", "forward_calls", "forward_seconds", "rejected")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    version: str
    addrs: _containers.RepeatedScalarFieldContainer[str]
    role: str
    client_mode: bool
    time: float
    experts: _containers.RepeatedScalarFieldContainer[str]
    reachability: str
    relays: _containers.RepeatedScalarFieldContainer[str]
    started: float
    links: _containers.RepeatedCompositeFieldContainer[LinkStat]
    runs: _containers.RepeatedScalarFieldContainer[str]
    expert_load: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    forward_calls: int
    forward_seconds: float
    rejected: _containers.RepeatedCompositeFieldContainer[RejectedAnswers]
    def __init__(self, peer_id: _Optional[str] = ..., version: _Optional[str] = ..., addrs: _Optional[_Iterable[str]] = ..., role: _Optional[str] = ..., client_mode: bool = ..., time: _Optional[float] = ..., experts: _Optional[_Iterable[str]] = ..., reachability: _Optional[str] = ..., relays: _Optional[_Iterable[str]] = ..., started: _Optional[float] = ..., links: _Optional[_Iterable[_Union[LinkStat, _Mapping]]] = ..., runs: _Optional[_Iterable[str]] = ..., expert_load: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ..., forward_calls: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., rejected: _Optional[_Iterable[_Union[RejectedAnswers, _Mapping]]] = ...) -> None: ...

class LinkStat(_message.Message):
    __slots__ = ("peer_id", "rtt", "throughput")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RTT_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    rtt: float
    throughput: float
    def __init__(self, peer_id: _Optional[str] = ..., rtt: _Optional[float] = ..., throughput: _Optional[float] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("uid", "batches", "queued")
    UID_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    uid: str
    batches: int
    queued: int
    def __init__(self, uid: _Optional[str] = ..., batches: _Optional[int] = ..., queued: _Optional[int] = ...) -> None: ...

class RejectedAnswers(_message.Message):
    __slots__ = ("server", "count")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    server: str
    count: int
    def __init__(self, server: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("challenge", "caller_peer_id")
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    CALLER_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    challenge: bytes
    caller_peer_id: str
    def __init__(self, challenge: _Optional[bytes] = ..., caller_peer_id: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("public_key", "signature")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    signature: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class BulkOpenRequest(_message.Message):
    __slots__ = ("method", "timeout")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    method: str
    timeout: float
    def __init__(self, method: _Optional[str] = ..., timeout: _Optional[float] = ...) -> None: ...

class BulkOpenResponse(_message.Message):
    __slots__ = ("port", "token", "reopen")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REOPEN_FIELD_NUMBER: _ClassVar[int]
    port: int
    token: bytes
    reopen: bool
    def __init__(self, port: _Optional[int] = ..., token: _Optional[bytes] = ..., reopen: bool = ...) -> None: ...

class CallRequest(_message.Message):
    __slots__ = ("id", "method", "payload", "timeout")
    ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    id: int
    method: str
    payload: bytes
    timeout: float
    def __init__(self, id: _Optional[int] = ..., method: _Optional[str] = ..., payload: _Optional[bytes] = ..., timeout: _Optional[float] = ...) -> None: ...

class CallResponse(_message.Message):
    __slots__ = ("id", "code", "details", "payload")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    details: str
    payload: bytes
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class CallRequests(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[CallRequest]
    def __init__(self, calls: _Optional[_Iterable[_Union[CallRequest, _Mapping]]] = ...) -> None: ...

class CallResponses(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[CallResponse]
    def __init__(self, calls: _Optional[_Iterable[_Union[CallResponse, _Mapping]]] = ...) -> None: ...
