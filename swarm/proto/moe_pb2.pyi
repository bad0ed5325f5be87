from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertInfoRequest(_message.Message):
    __slots__ = ("uid",)
    UID_FIELD_NUMBER: _ClassVar[int]
    uid: str
    def __init__(self, uid: _Optional[str] = ...) -> None: ...

class TensorSchema(_message.Message):
    __slots__ = ("shape", "dtype")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ExpertInfo(_message.Message):
    __slots__ = ("uid", "expert_class", "args_schema", "outputs_schema", "max_batch_size", "num_parameters", "updates")
    UID_FIELD_NUMBER: _ClassVar[int]
    EXPERT_CLASS_FIELD_NUMBER: _ClassVar[int]
    ARGS_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    uid: str
    expert_class: str
    args_schema: _containers.RepeatedCompositeFieldContainer[TensorSchema]
    outputs_schema: _containers.RepeatedCompositeFieldContainer[TensorSchema]
    max_batch_size: int
    num_parameters: int
    updates: int
    def __init__(self, uid: _Optional[str] = ..., expert_class: _Optional[str] = ..., args_schema: _Optional[_Iterable[_Union[TensorSchema, _Mapping]]] = ..., outputs_schema: _Optional[_Iterable[_Union[TensorSchema, _Mapping]]] = ..., max_batch_size: _Optional[int] = ..., num_parameters: _Optional[int] = ..., updates: _Optional[int] = ...) -> None: ...
