from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DHTStoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DHT_STORED: _ClassVar[DHTStoreStatus]
    DHT_OUTDATED: _ClassVar[DHTStoreStatus]
    DHT_INVALID: _ClassVar[DHTStoreStatus]
    DHT_REFUSED: _ClassVar[DHTStoreStatus]

class DHTValueType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DHT_NOT_FOUND: _ClassVar[DHTValueType]
    DHT_VALUE: _ClassVar[DHTValueType]
    DHT_DICTIONARY: _ClassVar[DHTValueType]
    DHT_OMITTED: _ClassVar[DHTValueType]
DHT_STORED: DHTStoreStatus
DHT_OUTDATED: DHTStoreStatus
DHT_INVALID: DHTStoreStatus
DHT_REFUSED: DHTStoreStatus
DHT_NOT_FOUND: DHTValueType
DHT_VALUE: DHTValueType
DHT_DICTIONARY: DHTValueType
DHT_OMITTED: DHTValueType

class DHTCaller(_message.Message):
    __slots__ = ("addrs",)
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    addrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, addrs: _Optional[_Iterable[str]] = ...) -> None: ...

class DHTPingRequest(_message.Message):
    __slots__ = ("caller",)
    CALLER_FIELD_NUMBER: _ClassVar[int]
    caller: DHTCaller
    def __init__(self, caller: _Optional[_Union[DHTCaller, _Mapping]] = ...) -> None: ...

class DHTPingResponse(_message.Message):
    __slots__ = ("dht_time",)
    DHT_TIME_FIELD_NUMBER: _ClassVar[int]
    dht_time: float
    def __init__(self, dht_time: _Optional[float] = ...) -> None: ...

class DHTStoreItem(_message.Message):
    __slots__ = ("raw_key", "subkey", "value", "expiration_time", "in_cache")
    RAW_KEY_FIELD_NUMBER: _ClassVar[int]
    SUBKEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPIRATION_TIME_FIELD_NUMBER: _ClassVar[int]
    IN_CACHE_FIELD_NUMBER: _ClassVar[int]
    raw_key: bytes
    subkey: bytes
    value: bytes
    expiration_time: float
    in_cache: bool
    def __init__(self, raw_key: _Optional[bytes] = ..., subkey: _Optional[bytes] = ..., value: _Optional[bytes] = ..., expiration_time: _Optional[float] = ..., in_cache: bool = ...) -> None: ...

class DHTStoreRequest(_message.Message):
    __slots__ = ("caller", "items", "count")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    caller: DHTCaller
    items: _containers.RepeatedCompositeFieldContainer[DHTStoreItem]
    count: int
    def __init__(self, caller: _Optional[_Union[DHTCaller, _Mapping]] = ..., items: _Optional[_Iterable[_Union[DHTStoreItem, _Mapping]]] = ..., count: _Optional[int] = ...) -> None: ...

class DHTStoreResult(_message.Message):
    __slots__ = ("status", "reason", "nearest")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NEAREST_FIELD_NUMBER: _ClassVar[int]
    status: DHTStoreStatus
    reason: str
    nearest: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Union[DHTStoreStatus, str]] = ..., reason: _Optional[str] = ..., nearest: _Optional[_Iterable[int]] = ...) -> None: ...

class DHTStoreResponse(_message.Message):
    __slots__ = ("results", "peers")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DHTStoreResult]
    peers: _containers.RepeatedCompositeFieldContainer[DHTPeer]
    def __init__(self, results: _Optional[_Iterable[_Union[DHTStoreResult, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[DHTPeer, _Mapping]]] = ...) -> None: ...

class DHTFindRequest(_message.Message):
    __slots__ = ("caller", "keys", "nodes_only", "values_suffice", "count")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NODES_ONLY_FIELD_NUMBER: _ClassVar[int]
    VALUES_SUFFICE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    caller: DHTCaller
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    nodes_only: bool
    values_suffice: bool
    count: int
    def __init__(self, caller: _Optional[_Union[DHTCaller, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., nodes_only: bool = ..., values_suffice: bool = ..., count: _Optional[int] = ...) -> None: ...

class DHTPeer(_message.Message):
    __slots__ = ("peer_id", "addr")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    addr: str
    def __init__(self, peer_id: _Optional[str] = ..., addr: _Optional[str] = ...) -> None: ...

class DHTFindResult(_message.Message):
    __slots__ = ("type", "value", "expiration_time", "nearest")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPIRATION_TIME_FIELD_NUMBER: _ClassVar[int]
    NEAREST_FIELD_NUMBER: _ClassVar[int]
    type: DHTValueType
    value: bytes
    expiration_time: float
    nearest: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, type: _Optional[_Union[DHTValueType, str]] = ..., value: _Optional[bytes] = ..., expiration_time: _Optional[float] = ..., nearest: _Optional[_Iterable[int]] = ...) -> None: ...

class DHTFindResponse(_message.Message):
    __slots__ = ("results", "peers")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DHTFindResult]
    peers: _containers.RepeatedCompositeFieldContainer[DHTPeer]
    def __init__(self, results: _Optional[_Iterable[_Union[DHTFindResult, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[DHTPeer, _Mapping]]] = ...) -> None: ...

class DHTLeaveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DHTLeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
