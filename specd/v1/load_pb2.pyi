from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("sessions", "kv_bytes", "queued_steps", "max_sessions", "max_kv_bytes")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    kv_bytes: int
    queued_steps: int
    max_sessions: int
    max_kv_bytes: int
    def __init__(self, sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., queued_steps: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_kv_bytes: _Optional[int] = ...) -> None: ...
