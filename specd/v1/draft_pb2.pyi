from specd.v1 import common_pb2 as _common_pb2
from specd.v1 import session_pb2 as _session_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[DraftRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[DraftRequest, _Mapping]]] = ...) -> None: ...

class DraftResponses(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[DraftResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[DraftResponse, _Mapping]]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "committed_length", "trace_context", "open", "propose", "close", "branches", "tree")
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
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    session_id: str
    committed_length: int
    trace_context: _containers.ScalarMap[str, str]
    open: DraftOpen
    propose: DraftPropose
    close: DraftClose
    branches: DraftBranches
    tree: DraftTreePropose
    def __init__(self, request_id: _Optional[int] = ..., session_id: _Optional[str] = ..., committed_length: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., open: _Optional[_Union[DraftOpen, _Mapping]] = ..., propose: _Optional[_Union[DraftPropose, _Mapping]] = ..., close: _Optional[_Union[DraftClose, _Mapping]] = ..., branches: _Optional[_Union[DraftBranches, _Mapping]] = ..., tree: _Optional[_Union[DraftTreePropose, _Mapping]] = ...) -> None: ...

class DraftClose(_message.Message):
    __slots__ = ("start", "token_ids")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftOpen(_message.Message):
    __slots__ = ("token_ids", "sampling", "wire_top_k", "tenant", "without_confidence")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WIRE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    wire_top_k: int
    tenant: str
    without_confidence: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., wire_top_k: _Optional[int] = ..., tenant: _Optional[str] = ..., without_confidence: _Optional[bool] = ...) -> None: ...

class DraftPropose(_message.Message):
    __slots__ = ("start", "token_ids", "num_tokens", "first_guesses_bonus")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_GUESSES_BONUS_FIELD_NUMBER: _ClassVar[int]
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    first_guesses_bonus: bool
    def __init__(self, start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., first_guesses_bonus: _Optional[bool] = ...) -> None: ...

class DraftBranches(_message.Message):
    __slots__ = ("start", "token_ids", "pending", "num_tokens", "budget", "acceptance")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    pending: int
    num_tokens: int
    budget: int
    acceptance: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., pending: _Optional[int] = ..., num_tokens: _Optional[int] = ..., budget: _Optional[int] = ..., acceptance: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftTreePropose(_message.Message):
    __slots__ = ("start", "token_ids", "budget", "depth")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    budget: int
    depth: int
    def __init__(self, start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., budget: _Optional[int] = ..., depth: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("request_id", "session_id", "committed_length", "proposal", "ack", "error", "branches", "tree", "timing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    session_id: str
    committed_length: int
    proposal: DraftProposal
    ack: _session_pb2.SessionAck
    error: _session_pb2.SessionError
    branches: DraftBranchSet
    tree: DraftTree
    timing: _session_pb2.ServiceTiming
    def __init__(self, request_id: _Optional[int] = ..., session_id: _Optional[str] = ..., committed_length: _Optional[int] = ..., proposal: _Optional[_Union[DraftProposal, _Mapping]] = ..., ack: _Optional[_Union[_session_pb2.SessionAck, _Mapping]] = ..., error: _Optional[_Union[_session_pb2.SessionError, _Mapping]] = ..., branches: _Optional[_Union[DraftBranchSet, _Mapping]] = ..., tree: _Optional[_Union[DraftTree, _Mapping]] = ..., timing: _Optional[_Union[_session_pb2.ServiceTiming, _Mapping]] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("token_ids", "q", "compute_ms", "batch_size", "confidence")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    compute_ms: float
    batch_size: int
    confidence: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., confidence: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftBranch(_message.Message):
    __slots__ = ("accepted", "token_id", "proposal")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    token_id: int
    proposal: DraftProposal
    def __init__(self, accepted: _Optional[int] = ..., token_id: _Optional[int] = ..., proposal: _Optional[_Union[DraftProposal, _Mapping]] = ...) -> None: ...

class DraftBranchSet(_message.Message):
    __slots__ = ("branches", "compute_ms", "batch_size")
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    branches: _containers.RepeatedCompositeFieldContainer[DraftBranch]
    compute_ms: float
    batch_size: int
    def __init__(self, branches: _Optional[_Iterable[_Union[DraftBranch, _Mapping]]] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("token_ids", "parents", "q", "compute_ms", "batch_size")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    compute_ms: float
    batch_size: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ...) -> None: ...
