from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionClose(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[SessionError.Code]
        CODE_SESSION_NOT_FOUND: _ClassVar[SessionError.Code]
        CODE_OUT_OF_SYNC: _ClassVar[SessionError.Code]
        CODE_INVALID_ARGUMENT: _ClassVar[SessionError.Code]
        CODE_RESOURCE_EXHAUSTED: _ClassVar[SessionError.Code]
        CODE_INTERNAL: _ClassVar[SessionError.Code]
        CODE_UNAVAILABLE: _ClassVar[SessionError.Code]
    CODE_UNSPECIFIED: SessionError.Code
    CODE_SESSION_NOT_FOUND: SessionError.Code
    CODE_OUT_OF_SYNC: SessionError.Code
    CODE_INVALID_ARGUMENT: SessionError.Code
    CODE_RESOURCE_EXHAUSTED: SessionError.Code
    CODE_INTERNAL: SessionError.Code
    CODE_UNAVAILABLE: SessionError.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: SessionError.Code
    message: str
    def __init__(self, code: _Optional[_Union[SessionError.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...

class ServiceTiming(_message.Message):
    __slots__ = ("queued_us", "batch_us", "reply_us")
    QUEUED_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_US_FIELD_NUMBER: _ClassVar[int]
    REPLY_US_FIELD_NUMBER: _ClassVar[int]
    queued_us: int
    batch_us: int
    reply_us: int
    def __init__(self, queued_us: _Optional[int] = ..., batch_us: _Optional[int] = ..., reply_us: _Optional[int] = ...) -> None: ...
