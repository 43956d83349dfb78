from specd.v1 import common_pb2 as _common_pb2
from specd.v1 import session_pb2 as _session_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_KIND_UNSPECIFIED: _ClassVar[TokenKind]
    TOKEN_KIND_RECOVERED: _ClassVar[TokenKind]
    TOKEN_KIND_BONUS: _ClassVar[TokenKind]
    TOKEN_KIND_DEFERRED: _ClassVar[TokenKind]
TOKEN_KIND_UNSPECIFIED: TokenKind
TOKEN_KIND_RECOVERED: TokenKind
TOKEN_KIND_BONUS: TokenKind
TOKEN_KIND_DEFERRED: TokenKind

class TargetRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[TargetRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[TargetRequest, _Mapping]]] = ...) -> None: ...

class TargetResponses(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[TargetResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[TargetResponse, _Mapping]]] = ...) -> None: ...

class TargetRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "committed_length", "trace_context", "open", "verify", "close", "verify_tree", "stage")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TREE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    session_id: str
    committed_length: int
    trace_context: _containers.ScalarMap[str, str]
    open: TargetOpen
    verify: Verify
    close: _session_pb2.SessionClose
    verify_tree: VerifyTree
    stage: StageVerify
    def __init__(self, request_id: _Optional[int] = ..., session_id: _Optional[str] = ..., committed_length: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., open: _Optional[_Union[TargetOpen, _Mapping]] = ..., verify: _Optional[_Union[Verify, _Mapping]] = ..., close: _Optional[_Union[_session_pb2.SessionClose, _Mapping]] = ..., verify_tree: _Optional[_Union[VerifyTree, _Mapping]] = ..., stage: _Optional[_Union[StageVerify, _Mapping]] = ...) -> None: ...

class TargetOpen(_message.Message):
    __slots__ = ("token_ids", "sampling")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class Verify(_message.Message):
    __slots__ = ("start", "token_ids", "draft_token_ids", "q", "defer_bonus")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    DEFER_BONUS_FIELD_NUMBER: _ClassVar[int]
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    defer_bonus: bool
    def __init__(self, start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., defer_bonus: _Optional[bool] = ...) -> None: ...

class VerifyTree(_message.Message):
    __slots__ = ("start", "token_ids", "draft_token_ids", "parents", "q")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

class StageVerify(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[StagedCandidate]
    def __init__(self, candidates: _Optional[_Iterable[_Union[StagedCandidate, _Mapping]]] = ...) -> None: ...

class StagedCandidate(_message.Message):
    __slots__ = ("accepted", "token_id", "draft_token_ids", "q", "deferred", "defer_bonus")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    DEFER_BONUS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    token_id: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    deferred: bool
    defer_bonus: bool
    def __init__(self, accepted: _Optional[int] = ..., token_id: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., deferred: _Optional[bool] = ..., defer_bonus: _Optional[bool] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("accepted", "token_id", "kind", "compute_ms", "batch_size", "batch_tokens")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    token_id: int
    kind: TokenKind
    compute_ms: float
    batch_size: int
    batch_tokens: int
    def __init__(self, accepted: _Optional[int] = ..., token_id: _Optional[int] = ..., kind: _Optional[_Union[TokenKind, str]] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ...) -> None: ...

class TreeVerdict(_message.Message):
    __slots__ = ("path", "token_id", "kind", "compute_ms", "batch_size", "batch_tokens")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    path: _containers.RepeatedScalarFieldContainer[int]
    token_id: int
    kind: TokenKind
    compute_ms: float
    batch_size: int
    batch_tokens: int
    def __init__(self, path: _Optional[_Iterable[int]] = ..., token_id: _Optional[int] = ..., kind: _Optional[_Union[TokenKind, str]] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ...) -> None: ...

class TargetResponse(_message.Message):
    __slots__ = ("request_id", "session_id", "committed_length", "verdict", "ack", "error", "tree_verdict", "timing", "staged_candidate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TREE_VERDICT_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    STAGED_CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    session_id: str
    committed_length: int
    verdict: Verdict
    ack: _session_pb2.SessionAck
    error: _session_pb2.SessionError
    tree_verdict: TreeVerdict
    timing: _session_pb2.ServiceTiming
    staged_candidate: int
    def __init__(self, request_id: _Optional[int] = ..., session_id: _Optional[str] = ..., committed_length: _Optional[int] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., ack: _Optional[_Union[_session_pb2.SessionAck, _Mapping]] = ..., error: _Optional[_Union[_session_pb2.SessionError, _Mapping]] = ..., tree_verdict: _Optional[_Union[TreeVerdict, _Mapping]] = ..., timing: _Optional[_Union[_session_pb2.ServiceTiming, _Mapping]] = ..., staged_candidate: _Optional[int] = ...) -> None: ...
