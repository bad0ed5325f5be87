from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DialBackRequest(_message.Message):
    __slots__ = ("addrs",)
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    addrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, addrs: _Optional[_Iterable[str]] = ...) -> None: ...

class DialBackResult(_message.Message):
    __slots__ = ("addr", "reachable", "error")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    addr: str
    reachable: bool
    error: str
    def __init__(self, addr: _Optional[str] = ..., reachable: bool = ..., error: _Optional[str] = ...) -> None: ...

class DialBackResponse(_message.Message):
    __slots__ = ("observed", "results", "relay")
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    observed: str
    results: _containers.RepeatedCompositeFieldContainer[DialBackResult]
    relay: str
    def __init__(self, observed: _Optional[str] = ..., results: _Optional[_Iterable[_Union[DialBackResult, _Mapping]]] = ..., relay: _Optional[str] = ...) -> None: ...
